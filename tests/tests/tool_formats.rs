//! The tool-call formats of today's models end to end (issue 56): tiny-qwen3
//! given a published chat template (Qwen3-Coder's, Mistral Small 3.2's,
//! Mistral Nemo's, gpt-oss's, as llama.cpp keeps them) in a copy of its
//! directory, served by a real coordinator and worker, the format and the
//! reasoning parser detected from the template (no flags).
//!
//! The weights are random, so the model calls a tool only when made to:
//! `tool_choice: "required"` forces a call in the model's own format with a
//! grammar, and the parser for that format must read it back, whole and
//! streamed, on chat completions and on Anthropic's Messages.

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, TempDir, post_json, post_sse, published_template};

/// A copy of tiny-qwen3 with the published template `file`.
fn model_with_template(file: &str) -> TempDir {
    tinyvllm_tests::model_with_template("tiny-qwen3", &format!("tool-format-{file}"), &published_template(file))
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Zurich", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            }, "required": ["city", "days"]},
        }},
        {"type": "function", "function": {
            "name": "get_time",
            "description": "The time in a zone",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]},
        }},
    ])
}

/// A call's arguments as the request's tools declare them.
fn check_arguments(name: &str, arguments: &Value) {
    match name {
        "get_weather" => {
            assert!(["Paris", "Zurich", "Lima"].contains(&arguments["city"].as_str().unwrap_or("")), "{arguments}");
            assert!((1..=7).contains(&arguments["days"].as_i64().unwrap_or(0)), "{arguments}");
        }
        "get_time" => assert!(["UTC", "CET"].contains(&arguments["zone"].as_str().unwrap_or("")), "{arguments}"),
        other => panic!("a call to {other}, which is not among the tools"),
    }
}

/// Markup a format writes around calls: none of it may show as content.
const MARKUP: [&str; 6] = ["<tool_call>", "<function=", "[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|message|>"];

fn no_markup(text: &str) {
    assert!(!MARKUP.iter().any(|m| text.contains(m)), "markup in {text:?}");
}

/// The first of a few seeds whose reply is a call: gpt-oss may think
/// first, and a random model's thinking rarely ends before `max_tokens`
/// (every reply is checked on the way: thinking is reasoning, never content).
fn reply_with_a_call(cluster: &Coordinator, path: &str, body: &Value, seed: u64) -> (Value, Value) {
    for seed in seed..seed + 12 {
        let mut body = body.clone();
        body["seed"] = json!(seed);
        let (status, reply) = post_json(&cluster.url(path), &body);
        assert_eq!(status, 200, "{reply}");
        let called = reply["choices"][0]["finish_reason"] == "tool_calls" || reply["stop_reason"] == "tool_use";
        if called {
            return (body, reply);
        }
        let message = &reply["choices"][0]["message"];
        assert!(message["content"].is_null() && message["tool_calls"].is_null(), "{reply}");
        for block in reply["content"].as_array().into_iter().flatten() {
            assert_eq!(block["type"], "thinking", "{reply}");
        }
    }
    panic!("no call in 12 seeds from {seed}");
}

/// A required call, whole and streamed on chat completions, then on Messages.
fn forced_calls(file: &str, seed: u64) {
    let model = model_with_template(file);
    let cluster = Coordinator::start(model.0.to_str().expect("path"), 1, &["--served-model-name", "tiny-tools"]);
    let body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris for two days?"}],
        "tools": tools(), "tool_choice": "required", "parallel_tool_calls": false,
        "max_tokens": 96, "temperature": 0.7,
    });
    let (body, reply) = reply_with_a_call(&cluster, "/v1/chat/completions", &body, seed);
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{file}: {reply}");
    let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{file}: {reply}");
    let name = calls[0]["function"]["name"].as_str().expect("name").to_string();
    let arguments: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("arguments")).expect("JSON arguments");
    check_arguments(&name, &arguments);
    no_markup(choice["message"]["content"].as_str().unwrap_or(""));
    no_markup(choice["message"]["reasoning_content"].as_str().unwrap_or(""));

    // Streamed: the same call, from its deltas.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let (chunks, done) = post_sse(&cluster.url("/v1/chat/completions"), &stream_body);
    assert!(done, "{file}");
    let deltas: Vec<&Value> =
        chunks.iter().flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    assert_eq!(deltas.first().map(|d| d["function"]["name"].clone()), Some(json!(name)), "{file}: {chunks:?}");
    let streamed: String = deltas.iter().filter_map(|d| d["function"]["arguments"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&streamed).expect("streamed arguments"), arguments, "{file}");
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    no_markup(&content);
    let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a last chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{file}");

    // Anthropic's Messages: tool_choice "any" forces it the same way.
    let anthropic_tools: Vec<Value> = tools()
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| {
            let f = &t["function"];
            json!({"name": f["name"], "description": f["description"], "input_schema": f["parameters"]})
        })
        .collect();
    let body = json!({
        "model": "tiny-tools", "max_tokens": 96, "temperature": 0.7,
        "messages": [{"role": "user", "content": "What time is it in UTC?"}],
        "tools": anthropic_tools, "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
    });
    let (body, reply) = reply_with_a_call(&cluster, "/v1/messages", &body, seed);
    assert_eq!(reply["stop_reason"], "tool_use", "{file}: {reply}");
    let blocks = reply["content"].as_array().expect("content");
    let uses: Vec<&Value> = blocks.iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{file}: {reply}");
    check_arguments(uses[0]["name"].as_str().expect("name"), &uses[0]["input"]);
    for block in blocks {
        no_markup(block["text"].as_str().or(block["thinking"].as_str()).unwrap_or(""));
    }

    // Streamed with the same seed (vLLM's extra field): the tool_use block's
    // input_json_delta pieces make the same input.
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let (events, _) = post_sse(&cluster.url("/v1/messages"), &stream_body);
    for event in &events {
        no_markup(event["delta"]["text"].as_str().or(event["delta"]["thinking"].as_str()).unwrap_or(""));
    }
    let delta = events.iter().find(|e| e["type"] == "message_delta").expect("message_delta");
    let started = events
        .iter()
        .find(|e| e["type"] == "content_block_start" && e["content_block"]["type"] == "tool_use")
        .unwrap_or_else(|| panic!("{file}: no tool_use block in {events:?}"));
    assert_eq!(delta["delta"]["stop_reason"], "tool_use", "{file}");
    let index = &started["index"];
    let input: String = events
        .iter()
        .filter(|e| e["type"] == "content_block_delta" && &e["index"] == index)
        .filter_map(|e| e["delta"]["partial_json"].as_str())
        .collect();
    let input: Value = serde_json::from_str(&input).expect("streamed input");
    assert_eq!(started["content_block"]["name"], uses[0]["name"], "{file}");
    assert_eq!(input, uses[0]["input"], "{file}");
}

#[test]
fn qwen3_coder_calls_in_its_xml() {
    forced_calls("qwen3-coder.jinja", 1);
}

#[test]
fn mistral_calls_by_name_and_in_a_list() {
    forced_calls("mistral-small-3.2.jinja", 2);
    forced_calls("mistral-nemo.jinja", 3);
}

/// gpt-oss: the Harmony template makes both the tool-call and the
/// reasoning parser Harmony's; a call may follow an analysis message,
/// which is reasoning, never content.
#[test]
fn gpt_oss_calls_on_the_commentary_channel() {
    forced_calls("gpt-oss.jinja", 4);
}
