//! The README's first command, as a new user runs it on a machine with no
//! network: `tinyvllm-coordinator --local-workers 2`, no model named,
//! serves the model built into the binaries (stories260K, a real trained
//! model), and it writes a story.

use serde_json::json;
use tinyvllm_tests::{Coordinator, post_json};

#[test]
fn the_first_command_serves_the_builtin_model_offline() {
    let cluster = Coordinator::start("", 2, &[]);
    let models: serde_json::Value =
        ureq::get(&cluster.url("/v1/models")).call().expect("GET /v1/models").into_json().expect("json");
    assert_eq!(models["data"][0]["id"], "stories260K", "{models}");
    // Karpathy's published greedy sample of stories260K begins so.
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0});
    let (status, reply) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 200, "{reply}");
    let text = reply["choices"][0]["text"].as_str().expect("text");
    assert!(text.starts_with(", there was a little girl named Lily."), "{text:?}");
    let workers = cluster.workers();
    assert_eq!(workers["data"].as_array().map(Vec::len), Some(2), "{workers}");
    assert!(workers["data"].as_array().into_iter().flatten().all(|w| w["joined_by"] == "local"), "{workers}");
}
