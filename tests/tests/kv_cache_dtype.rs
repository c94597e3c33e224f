//! `--kv-cache-dtype` end to end: real coordinators and workers (one
//! worker, and a pipeline of two stages) on loopback with the option passed
//! through `--worker-arg`. The same `--kv-cache-memory` holds 2x the tokens
//! in f16 and 2.67x in q8_0 (stories260K's head_dim of 8: rows of 12 bytes
//! against 32), `/v1/workers` and the worker's metrics show the dtype and
//! the capacity, and the narrow caches serve.

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, post_json};

const MEMORY: &str = "--worker-arg=--kv-cache-memory=2000000";

/// The worker's (dtype, token capacity, blocks) in `/v1/workers`.
fn kv_of(cluster: &Coordinator) -> (String, u64, u64) {
    let workers = cluster.workers();
    let w = &workers["data"][0];
    let blocks = w["stats"]["kv_blocks_total"].as_u64().expect("blocks");
    (
        w["kv_cache_dtype"].as_str().expect("a dtype").to_string(),
        w["kv_capacity_tokens"].as_u64().expect("tokens"),
        blocks,
    )
}

fn completes(cluster: &Coordinator) {
    let body = json!({"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (status, out) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["usage"]["completion_tokens"], 24, "{out}");
}

#[test]
fn narrow_caches_hold_more_tokens_in_the_same_memory_and_say_so() {
    let mut capacity = Vec::new();
    for dtype in ["auto", "f16", "q8_0"] {
        let arg = format!("--worker-arg=--kv-cache-dtype={dtype}");
        let cluster = Coordinator::start("stories260K", 1, &[MEMORY, &arg]);
        let (shown, tokens, blocks) = kv_of(&cluster);
        assert_eq!(shown, if dtype == "auto" { "f32" } else { dtype });
        assert_eq!(tokens, blocks * 16, "{dtype}: capacity is blocks x block size");
        completes(&cluster);
        let targets: Value =
            ureq::get(&cluster.url("/v1/prometheus/targets")).call().expect("targets").into_json().expect("json");
        let metrics_at = targets[0]["targets"][0].as_str().expect("a worker target");
        let text = ureq::get(&format!("http://{metrics_at}/metrics")).call().expect("scrape").into_string().unwrap();
        assert!(text.contains(&format!("cache_dtype=\"{shown}\"")), "{text}");
        assert!(
            text.lines()
                .any(|l| l.starts_with("tinyvllm_kv_cache_capacity_tokens{") && l.ends_with(&format!(" {tokens}"))),
            "{text}"
        );
        capacity.push(tokens as f64);
    }
    let (f16, q8) = (capacity[1] / capacity[0], capacity[2] / capacity[0]);
    assert!((f16 - 2.0).abs() < 0.02, "f16 holds {f16}x the tokens of f32");
    assert!((q8 - 32.0 / 12.0).abs() < 0.02, "q8_0 holds {q8}x the tokens of f32");
}

#[test]
fn a_pipeline_runs_one_cache_dtype_on_every_stage() {
    let cluster = Coordinator::start_pipelines("stories260K", 1, 2, &[MEMORY, "--worker-arg=--kv-cache-dtype=q8_0"]);
    let (shown, tokens, blocks) = kv_of(&cluster);
    assert_eq!((shown.as_str(), tokens), ("q8_0", blocks * 16));
    let workers = cluster.workers();
    let stages = workers["data"][0]["stages"].as_array().expect("stages").clone();
    assert_eq!(stages.len(), 2);
    assert!(
        stages.iter().all(|s| s["kv_cache_dtype"] == "q8_0" && s["kv_capacity_tokens"].as_u64() >= Some(tokens)),
        "{stages:?}"
    );
    completes(&cluster);
}
