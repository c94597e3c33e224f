//! Reasoning split from the answer (`--reasoning-parser`) on a real
//! cluster: the model is made to write `<think>...</think>` then an answer
//! (a regex constraint over the whole output, thinking included, with
//! `--structured-outputs-in-reasoning`, drives tiny-qwen3's random
//! weights), and chat
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
    let cluster =
        Coordinator::start("tiny-qwen3", 1, &["--reasoning-parser", "qwen3", "--structured-outputs-in-reasoning"]);
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

/// Events of an SSE response: (event name, data).
fn events(url: &str, body: Value) -> Vec<(String, Value)> {
    let resp = ureq::post(url).send_json(body).expect("stream");
    let mut out = Vec::new();
    let mut name = String::new();
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line.expect("line");
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(data) = line.strip_prefix("data: ") {
            out.push((name.clone(), serde_json::from_str(data).expect("event JSON")));
        }
    }
    out
}

/// With `deepseek_r1` the output starts inside the thinking: a random
/// model that never closes it thinks the whole reply, which the agent APIs
/// give as Anthropic's `thinking` block and the Responses API's
/// `reasoning` item, whole and streamed, with no answer text.
#[test]
fn the_agent_apis_carry_the_thinking_apart() {
    let cluster = Coordinator::start(
        "tiny-qwen3",
        1,
        &["--reasoning-parser", "deepseek_r1", "--structured-outputs-in-reasoning"],
    );
    let hello = json!([{"role": "user", "content": "Hello"}]);
    let messages = json!({"max_tokens": 8, "temperature": 0, "messages": hello});
    let (status, whole) = post_json(&cluster.url("/v1/messages"), &messages);
    assert_eq!(status, 200, "{whole}");
    let blocks = whole["content"].as_array().expect("content");
    assert_eq!((blocks.len(), &blocks[0]["type"]), (1, &json!("thinking")), "{whole}");
    let thinking = blocks[0]["thinking"].as_str().expect("thinking").to_string();
    assert!(!thinking.is_empty());
    let mut body = messages.clone();
    body["stream"] = json!(true);
    let streamed: String = events(&cluster.url("/v1/messages"), body)
        .iter()
        .filter(|(name, data)| name == "content_block_delta" && data["delta"]["type"] == "thinking_delta")
        .map(|(_, data)| data["delta"]["thinking"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(streamed, thinking);
    let responses = json!({"input": "Hello", "max_output_tokens": 8, "temperature": 0});
    let (status, whole) = post_json(&cluster.url("/v1/responses"), &responses);
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["output"][0]["type"], "reasoning", "{whole}");
    assert_eq!(whole["output"][0]["content"][0]["text"], json!(thinking), "{whole}");
    let mut body = responses.clone();
    body["stream"] = json!(true);
    let events = events(&cluster.url("/v1/responses"), body);
    let streamed: String = events
        .iter()
        .filter(|(name, _)| name == "response.reasoning_text.delta")
        .map(|(_, data)| data["delta"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(streamed, thinking);
    let (_, completed) = events.last().expect("events");
    assert_eq!(completed["response"]["output"][0]["type"], "reasoning", "{completed}");
}

/// `chat_template_kwargs` reach the template (vLLM's field): Qwen3's
/// published template closes an empty thinking in the prompt when
/// `enable_thinking` is false, on `/tokenize` as on chat completions.
#[test]
fn chat_template_kwargs_reach_the_template() {
    let template = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../coordinator/src/text/testdata/published/qwen3.jinja"),
    )
    .expect("Qwen3's published template");
    let dir = tinyvllm_tests::TempDir::new("qwen3-template");
    let source = tinyvllm_tests::model_dir("tiny-qwen3");
    for entry in std::fs::read_dir(&source).expect("model dir") {
        let name = entry.expect("entry").file_name();
        if name != "tokenizer_config.json" {
            std::os::unix::fs::symlink(source.join(&name), dir.0.join(&name)).expect("link");
        }
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("tokenizer_config.json")).unwrap()).unwrap();
    config["chat_template"] = json!(template);
    std::fs::write(dir.0.join("tokenizer_config.json"), config.to_string()).unwrap();
    let cluster = Coordinator::start(dir.0.to_str().unwrap(), 1, &["--served-model-name", "tiny-qwen3"]);
    let messages = json!([{"role": "user", "content": "Hello"}]);
    let tokens = |kwargs: Value| {
        let body = json!({"messages": messages, "chat_template_kwargs": kwargs, "return_token_strs": true});
        let (status, out) = post_json(&cluster.url("/tokenize"), &body);
        assert_eq!(status, 200, "{out}");
        out["token_strs"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect::<String>()
    };
    let (thinking, not) = (tokens(json!({})), tokens(json!({"enable_thinking": false})));
    assert!(!thinking.contains("</think>") && not.contains("</think>"), "{thinking:?} / {not:?}");
    let body = json!({"messages": messages, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": false}});
    let (status, out) = post_json(&cluster.url("/v1/chat/completions"), &body);
    assert_eq!(status, 200, "{out}");
    let (status, out) =
        post_json(&cluster.url("/v1/chat/completions"), &json!({"messages": messages, "chat_template_kwargs": 3}));
    assert_eq!((status, out["error"]["param"].as_str()), (400, Some("chat_template_kwargs")), "{out}");
}

/// A copy of tiny-qwen3 with the published template `file`, served with
/// the reasoning parser detected from it.
fn with_published(file: &str) -> (tinyvllm_tests::TempDir, Coordinator) {
    let model = tinyvllm_tests::model_with_template(
        "tiny-qwen3",
        &format!("published-{file}"),
        &tinyvllm_tests::published_template(file),
    );
    let cluster = Coordinator::start(model.0.to_str().expect("path"), 1, &["--served-model-name", "tiny-qwen3"]);
    (model, cluster)
}

/// A structured output applies once the thinking ends (vLLM's rule): the
/// model may think first, in its own markup, and the answer is what the
/// schema asks for. Qwen3's and gpt-oss's published templates make their
/// parsers detected; a random model's thinking rarely ends, so a few seeds
/// are tried until one finishes, each reply checked on the way.
#[test]
fn structured_outputs_follow_the_thinking() {
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["n"], "additionalProperties": false});
    for file in ["qwen3.jinja", "gpt-oss.jinja"] {
        let (_model, cluster) = with_published(file);
        let mut finished = 0;
        for seed in 0..16 {
            let body = json!({
                "messages": [{"role": "user", "content": "Pick a digit."}], "max_tokens": 48, "seed": seed,
                "temperature": 0.8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "digit", "schema": schema}},
            });
            let (status, reply) = post_json(&cluster.url("/v1/chat/completions"), &body);
            assert_eq!(status, 200, "{file}: {reply}");
            let message = &reply["choices"][0]["message"];
            let reasoning = message["reasoning_content"].as_str().unwrap_or("");
            assert!(!reasoning.contains("<|") && !reasoning.contains("</think>"), "{file}: {reply}");
            if reply["choices"][0]["finish_reason"] != "stop" {
                // Cut while thinking: no answer, or (the answer's channel
                // opened at the very end) an empty one.
                let content = &message["content"];
                assert!(content.is_null() || content == "", "{file}: cut while thinking, no answer yet: {reply}");
                continue;
            }
            let content = message["content"].as_str().expect("an answer");
            let answer: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{file}: {e}: {content:?}"));
            assert!(answer["n"].as_i64().is_some_and(|n| (0..=9).contains(&n)), "{file}: {answer}");
            finished += 1;
        }
        assert!(finished > 0, "{file}: no reply finished in 16 seeds");
    }
}

/// Reasoning sent back in the history renders through the template: chat's
/// `reasoning_content` as Qwen3's `<think>` and gpt-oss's analysis message,
/// Anthropic's thinking blocks the same way.
#[test]
fn reasoning_in_the_history_renders_through_the_template() {
    let call = json!([{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need the tool.", "tool_calls": call},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]);
    for (file, expected) in [
        ("qwen3.jinja", "<think>\nNeed the tool.\n</think>"),
        ("gpt-oss.jinja", "<|channel|>analysis<|message|>Need the tool.<|end|>"),
    ] {
        let (_model, cluster) = with_published(file);
        let rendered = |messages: &Value| {
            let (status, out) = post_json(&cluster.url("/tokenize"), &json!({"messages": messages, "tools": tools}));
            assert_eq!(status, 200, "{file}: {out}");
            let (status, text) = post_json(&cluster.url("/detokenize"), &json!({"tokens": out["tokens"]}));
            assert_eq!(status, 200, "{file}: {text}");
            text["prompt"].as_str().expect("prompt").to_string()
        };
        let prompt = rendered(&messages);
        assert!(prompt.contains(expected), "{file}: {prompt}");
        // Anthropic's thinking block is the same reasoning.
        let body = json!({"model": "tiny-qwen3", "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need the tool.", "signature": ""},
                {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]},
        ], "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}]});
        let (status, counted) = post_json(&cluster.url("/v1/messages/count_tokens"), &body);
        assert_eq!(status, 200, "{file}: {counted}");
        let (_, without) = post_json(&cluster.url("/v1/messages/count_tokens"), &{
            let mut b = body.clone();
            b["messages"][1]["content"].as_array_mut().expect("blocks").remove(0);
            b
        });
        assert!(counted["input_tokens"].as_u64() > without["input_tokens"].as_u64(), "{file}: {counted} / {without}");
    }
}
