//! Prefix-aware routing end to end: real workers publish KV events over
//! QUIC, the coordinator indexes them and routes a prompt sharing a long
//! prefix to the worker that holds it.

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, post_json};

/// A prompt of token ids: a 200-token prefix shared by every caller (from
/// `seed`), then a few tokens of its own.
fn prompt(prefix_seed: u32, suffix: u32) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..200).map(|i| 3 + (prefix_seed * 31 + i * 7) % 500).collect();
    ids.extend((0..8).map(|i| 3 + (suffix * 13 + i) % 500));
    ids
}

fn complete(cluster: &Coordinator, ids: &[u32]) -> Value {
    let body = json!({"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let (status, out) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 200, "{out}");
    out
}

/// The sum of a counter's series in the coordinator's /metrics.
fn metric_sum(cluster: &Coordinator, name: &str) -> f64 {
    let text = ureq::get(&cluster.url("/metrics")).call().expect("GET /metrics").into_string().expect("text");
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_shared_prefix_lands_on_the_worker_that_cached_it() {
    let cluster = Coordinator::start("stories260K", 2, &["--policy", "prefix_aware"]);
    let first = complete(&cluster, &prompt(1, 1));
    let second = complete(&cluster, &prompt(1, 2));
    assert_eq!(first["choices"][0]["cached_tokens"], 0);
    assert_eq!(second["choices"][0]["worker"], first["choices"][0]["worker"], "{first}\n{second}");
    // 200 shared tokens = 12 full blocks of 16.
    assert_eq!(second["choices"][0]["cached_tokens"], 192);
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], 192);
    // A different prefix goes to the idle worker rather than queueing behind nothing.
    let other = complete(&cluster, &prompt(2, 1));
    assert_eq!(other["choices"][0]["cached_tokens"], 0);
    // The router predicted exactly what the workers found.
    assert_eq!(metric_sum(&cluster, "tinyvllm_router_predicted_cached_tokens_total"), 192.0);
    assert_eq!(metric_sum(&cluster, "tinyvllm_router_actual_cached_tokens_total"), 192.0);
    assert_eq!(metric_sum(&cluster, "tinyvllm_router_decisions_total"), 3.0);
}

#[test]
fn round_robin_ignores_the_cache() {
    let cluster = Coordinator::start("stories260K", 2, &["--policy", "round_robin"]);
    let first = complete(&cluster, &prompt(1, 1));
    let second = complete(&cluster, &prompt(1, 2));
    assert_ne!(second["choices"][0]["worker"], first["choices"][0]["worker"]);
    assert_eq!(second["choices"][0]["cached_tokens"], 0);
    let third = complete(&cluster, &prompt(1, 3));
    assert_eq!(third["choices"][0]["worker"], first["choices"][0]["worker"]);
    assert_eq!(third["choices"][0]["cached_tokens"], 192);
}

#[test]
fn workers_are_listed_for_prometheus_discovery() {
    let cluster = Coordinator::start("stories260K", 2, &[]);
    let targets: Value =
        ureq::get(&cluster.url("/v1/prometheus/targets")).call().expect("targets").into_json().expect("json");
    let targets = targets.as_array().expect("http_sd list");
    assert_eq!(targets.len(), 2, "{targets:?}");
    for group in targets {
        let target = group["targets"][0].as_str().expect("target");
        assert!(target.starts_with("127.0.0.1:"), "{target}");
        assert_eq!(group["labels"]["model_name"], "stories260K");
        // The target really serves the worker's metrics.
        let text = ureq::get(&format!("http://{target}/metrics")).call().expect("scrape").into_string().expect("text");
        assert!(text.contains("vllm:num_requests_running{"), "{text}");
        assert!(text.contains(&format!("worker=\"{}\"", group["labels"]["worker"].as_str().expect("name"))));
    }
}
