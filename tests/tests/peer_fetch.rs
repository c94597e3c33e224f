//! Peer fetch (issue 60, point 3) with real workers over real QUIC: two
//! workers with a second tier behind a round-robin coordinator, so a
//! prompt served by one goes next to the other, which lacks its prefix.
//! The holder sends the blocks (relayed by the coordinator), the other
//! keeps them in its tier and restores them: its answer is the first
//! one's, token for token, with the prefix counted as cached. A holder
//! frozen and then killed mid-fetch releases the request, which is then
//! computed, exactly.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, post_json, signal};

const MODEL: &str = "stories260K";

fn complete(cluster: &Coordinator, prompt: &[u32]) -> (String, String, u64) {
    let body = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let (status, out): (u16, Value) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 200, "{out}");
    let choice = &out["choices"][0];
    let text = choice["text"].as_str().expect("text").to_string();
    let worker = choice["worker"].as_str().expect("the worker").to_string();
    let cached = out["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    (text, worker, cached)
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..300u32).map(|i| (i * 7 + seed * 13) % 480 + 20).collect()
}

#[test]
fn a_prefix_is_fetched_from_the_peer_holding_it_and_a_killed_peer_is_survived() {
    let (cluster, log) = Coordinator::start_logged(
        MODEL,
        2,
        &[
            "--policy",
            "round_robin",
            "--worker-arg=--kv-offload-bytes=64000000",
            "--worker-arg=--kv-cache-memory=8000000",
        ],
    );
    let p = prompt(1);
    let (text, first, cached) = complete(&cluster, &p);
    assert_eq!(cached, 0);
    let (again, second, cached) = complete(&cluster, &p);
    assert_ne!(first, second, "round robin: the other worker");
    assert_eq!(again, text, "the fetched prefix gives the same tokens");
    assert!(cached >= 288, "the 18 full blocks came from {first}: {cached} cached");

    // The holder of another prompt's prefix is frozen, asked, then killed.
    let q = prompt(2);
    let (text, holder, _) = complete(&cluster, &q);
    let pid = cluster.local_worker_pid(&holder).expect("the holder's pid");
    signal(pid, "-STOP");
    let started = Instant::now();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        signal(pid, "-KILL");
    });
    let (again, other, _) = complete(&cluster, &q);
    killer.join().expect("the killer");
    assert_ne!(other, holder);
    assert_eq!(again, text, "computed instead, exactly");
    assert!(started.elapsed() < Duration::from_secs(10), "released within {:?}", started.elapsed());
    assert!(
        log.text().contains("prefix fetch was given up"),
        "the fetch was asked of the frozen holder:\n{}",
        log.text()
    );
}

/// A worker that drains hands its cached blocks to a peer before it exits:
/// the prompt it served is then a (tier) hit on the other worker, exactly.
#[test]
fn a_draining_worker_hands_its_cache_to_a_peer() {
    let (cluster, log) = Coordinator::start_logged(
        MODEL,
        2,
        &["--worker-arg=--kv-offload-bytes=64000000", "--worker-arg=--kv-cache-memory=8000000"],
    );
    let p = prompt(3);
    let (text, first, _) = complete(&cluster, &p);
    let pid = cluster.local_worker_pid(&first).expect("its pid");
    signal(pid, "-TERM");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !log.text().contains("KV handoff passed on") {
        assert!(Instant::now() < deadline, "no handoff:\n{}", log.text());
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(500)); // the peer's tier events reach the router
    let (again, second, cached) = complete(&cluster, &p);
    assert_eq!(again, text);
    assert!(cached >= 288, "served by {second} with {cached} cached (the first was {first}):\n{}", log.text());
}
