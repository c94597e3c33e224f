//! Bursts through a real cluster (issue 31): two back-to-back bursts of 70
//! requests sharing a cached prompt went 70/0/0 and 46/24/0 over 3 workers,
//! because the router counted such requests as nearly free. It now counts a
//! dispatched request's context at once, and `/v1/workers` shows the load
//! the router counts, not only the workers' last stats.
//!
//! How a burst spreads depends on how the requests' arrivals interleave
//! with their completions, which thread timing decides; the spread itself
//! is checked exactly, on plain integers, by the router's
//! `back_to_back_bursts_spread_evenly` (coordinator/src/router/tests.rs).
//! Here every request of both bursts must be served by a registered worker,
//! and the load the router counts must match what it shows.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, post_json};

/// A 208-token prompt (13 blocks), the same for every request.
fn prompt() -> Vec<u32> {
    (0..208).map(|i| 3 + (i * 7) % 500).collect()
}

fn burst(cluster: &Coordinator, n: usize) -> BTreeMap<String, usize> {
    let handles: Vec<_> = (0..n)
        .map(|_| {
            let url = cluster.url("/v1/completions");
            std::thread::spawn(move || {
                let body = json!({"prompt": prompt(), "max_tokens": 48, "temperature": 0, "ignore_eos": true});
                let (status, out) = post_json(&url, &body);
                assert_eq!(status, 200, "{out}");
                out["choices"][0]["worker"].as_str().expect("worker").to_string()
            })
        })
        .collect();
    let mut counts = BTreeMap::new();
    for h in handles {
        *counts.entry(h.join().expect("request thread")).or_insert(0) += 1;
    }
    counts
}

#[test]
fn back_to_back_bursts_of_70_are_all_served_and_counted() {
    let cluster = Coordinator::start("stories260K", 3, &["--policy", "prefix_aware"]);
    // One worker caches the prompt first.
    let body = json!({"prompt": prompt(), "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    assert_eq!(post_json(&cluster.url("/v1/completions"), &body).0, 200);
    let names: Vec<String> = cluster.workers()["data"]
        .as_array()
        .expect("workers")
        .iter()
        .map(|w| w["name"].as_str().expect("name").to_string())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for round in 0..2 {
        let counts = burst(&cluster, 70);
        assert_eq!(counts.values().sum::<usize>(), 70, "round {round}: {counts:?}");
        assert!(counts.keys().all(|w| names.contains(w)), "round {round}: {counts:?} vs {names:?}");
    }
    // The load /v1/workers shows is the router's own, counted at dispatch.
    let workers: Value = cluster.workers();
    for w in workers["data"].as_array().expect("workers") {
        let load = &w["load"];
        let counted = load["running"].as_u64().unwrap_or(0) + load["waiting"].as_u64().unwrap_or(0);
        assert_eq!(Some(counted), w["in_flight_requests"].as_u64(), "{w}");
    }
}
