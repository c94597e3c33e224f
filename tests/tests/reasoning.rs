//! Reasoning split from the answer (`--reasoning-parser`) on a real
//! cluster: the model is made to write `<think>...</think>` then an answer
//! (a regex constraint drives tiny-qwen3's random weights), and chat
//! completions give the thinking as `reasoning_content`, whole and
//! streamed, the answer as `content`.

use std::io::BufRead;

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, post_json};

fn request(stream: bool) -> Value {
    json!({
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 40, "temperature": 0, "stream": stream,
        "guided_regex": "<think>[a-z]{3,6}</think>[a-z]{2,5}",
    })
}

#[test]
fn chat_completions_split_the_thinking_from_the_answer() {
    let cluster = Coordinator::start("tiny-qwen3", 1, &["--reasoning-parser", "qwen3"]);
    let url = cluster.url("/v1/chat/completions");
    let (status, whole) = post_json(&url, &request(false));
    assert_eq!(status, 200, "{whole}");
    let message = &whole["choices"][0]["message"];
    let (reasoning, content) = (message["reasoning_content"].as_str().unwrap(), message["content"].as_str().unwrap());
    assert!((3..=6).contains(&reasoning.len()) && reasoning.chars().all(|c| c.is_ascii_lowercase()), "{message}");
    assert!((2..=5).contains(&content.len()) && !content.contains("think"), "{message}");
    // Streamed: the deltas add up to the same two texts.
    let resp = ureq::post(&url).send_json(request(true)).expect("stream");
    let (mut streamed_reasoning, mut streamed_content) = (String::new(), String::new());
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line.expect("line");
        let Some(data) = line.strip_prefix("data: ").filter(|d| *d != "[DONE]") else { continue };
        let chunk: Value = serde_json::from_str(data).expect("chunk");
        let delta = &chunk["choices"][0]["delta"];
        streamed_reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        streamed_content.push_str(delta["content"].as_str().unwrap_or_default());
    }
    assert_eq!((streamed_reasoning.as_str(), streamed_content.as_str()), (reasoning, content));
    // Without the parser, the tags stay in the content.
    let plain = Coordinator::start("tiny-qwen3", 1, &[]);
    let (_, whole) = post_json(&plain.url("/v1/chat/completions"), &request(false));
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        text.starts_with("<think>") && whole["choices"][0]["message"].get("reasoning_content").is_none(),
        "{whole}"
    );
}
