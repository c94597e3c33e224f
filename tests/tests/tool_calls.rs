//! Tool calling end to end (issue 32): tiny-qwen3 given a tool-capable
//! chat template (Qwen 2.5's, which writes Hermes `<tool_call>` blocks, or
//! a Llama 3.1-style one, which asks for `{"name", "parameters"}` JSON) in
//! a copy of its directory, served by a real coordinator and worker.
//!
//! Tiny-qwen3's weights are random, so it calls a tool only when made to:
//! `tool_choice: "required"` or a named function, which the worker forces
//! with the grammar the coordinator builds (its structured outputs).

use std::path::Path;

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, TempDir, model_dir, post_json, post_sse, repo_root, run_python_client, test_python};

/// A Llama 3.1-style template: tools in the first user turn, calls as
/// `{"name": ..., "parameters": ...}`, results from the `ipython` role.
const LLAMA31_TEMPLATE: &str = r#"{{- bos_token }}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
{{- "Environment: ipython\n" }}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] | trim }}
{%- set messages = messages[1:] %}
{%- endif %}
{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if loop.first and tools is not none and message.role == 'user' %}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' }}
{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
{%- for t in tools %}
{{- t | tojson(indent=4) }}
{{- "\n\n" }}
{%- endfor %}
{{- message['content'] | trim + '<|eot_id|>' }}
{%- elif message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- for tool_call in message.tool_calls %}
{{- '{"name": "' + tool_call.function.name + '", "parameters": ' + tool_call.function.arguments | tojson + '}' }}
{%- endfor %}
{{- "<|eot_id|>" }}
{%- elif message.role == 'tool' %}
{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" + message.content + "<|eot_id|>" }}
{%- else %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

/// Qwen 2.5's template (with tools), from the chat-template test data.
fn qwen25_template() -> String {
    let path = repo_root().join("coordinator/src/text/testdata/chat_templates.json");
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("test data")).expect("json");
    let case = cases.as_array().and_then(|c| c.iter().find(|c| c["id"] == "qwen25_tools")).expect("qwen25_tools");
    case["template"].as_str().expect("template").to_string()
}

/// A copy of tiny-qwen3 (its large files linked) whose tokenizer_config.json
/// carries `template`.
fn model_with_template(tag: &str, template: &str) -> TempDir {
    let dir = TempDir::new(tag);
    let source = model_dir("tiny-qwen3");
    for entry in std::fs::read_dir(&source).expect("model dir") {
        let name = entry.expect("entry").file_name();
        if name != "tokenizer_config.json" {
            std::os::unix::fs::symlink(source.join(&name), dir.0.join(&name)).expect("link");
        }
    }
    let config = std::fs::read_to_string(source.join("tokenizer_config.json")).expect("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&config).expect("json");
    config["chat_template"] = json!(template);
    std::fs::write(dir.0.join("tokenizer_config.json"), config.to_string()).expect("write");
    dir
}

fn start(model: &Path, extra: &[&str]) -> Coordinator {
    let mut args = vec!["--served-model-name", "tiny-tools"];
    args.extend_from_slice(extra);
    Coordinator::start(model.to_str().expect("utf-8 path"), 1, &args)
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Zurich", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    }})
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]},
    }})
}

/// A conversation whose history holds a call and its result.
fn history() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Weather in Paris?"}),
        json!({"role": "assistant", "content": null, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"},
        }]}),
        json!({"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}),
    ]
}

/// The prompt text a conversation becomes (POST /tokenize, then /detokenize).
fn rendered(cluster: &Coordinator, messages: &[Value], tools: &[Value]) -> String {
    let (status, tokens) = post_json(&cluster.url("/tokenize"), &json!({"messages": messages, "tools": tools}));
    assert_eq!(status, 200, "{tokens}");
    let (status, text) = post_json(&cluster.url("/detokenize"), &json!({"tokens": tokens["tokens"]}));
    assert_eq!(status, 200, "{text}");
    text["prompt"].as_str().expect("prompt").to_string()
}

#[test]
fn tools_and_history_reach_the_template() {
    let model = model_with_template("tools-hermes", &qwen25_template());
    let cluster = start(&model.0, &[]);
    let tools = [weather_tool()];
    let prompt = rendered(&cluster, &history(), &tools);
    assert!(prompt.contains("<tools>\n{\"function\": {\"description\": \"The weather in a city\""), "{prompt}");
    // The call's arguments (JSON text in the request) rendered as an object.
    let call =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 1}}\n</tool_call>";
    assert!(prompt.contains(call), "{prompt}");
    assert!(prompt.contains("<tool_response>\n{\"temp\": 21}\n</tool_response>"), "{prompt}");

    // auto and none answer in text: the model's own words, no calls.
    for choice in ["auto", "none"] {
        let body =
            json!({"messages": history(), "tools": tools, "tool_choice": choice, "max_tokens": 8, "temperature": 0});
        let (status, reply) = post_json(&cluster.url("/v1/chat/completions"), &body);
        assert_eq!(status, 200, "{reply}");
        let message = &reply["choices"][0]["message"];
        assert!(message["content"].is_string() && message.get("tool_calls").is_none(), "{reply}");
        assert_eq!(reply["choices"][0]["finish_reason"], "length", "{reply}");
    }
}

#[test]
fn bad_tool_requests_are_400s_naming_the_field() {
    let model = model_with_template("tools-bad", &qwen25_template());
    let cluster = start(&model.0, &[]);
    let user = json!([{"role": "user", "content": "hi"}]);
    let tool = weather_tool();
    for (body, param) in [
        (json!({"messages": user, "tools": "get_weather"}), "tools"),
        (json!({"messages": user, "tools": [{"type": "function"}]}), "tools[0].function"),
        (
            json!({"messages": user, "tools": [{"function": {"name": "f", "parameters": {"type": "string"}}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"messages": user, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"messages": user, "tools": [tool], "tool_choice": "always"}), "tool_choice"),
        (json!({"messages": user, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": user, "tools": [tool], "parallel_tool_calls": "yes"}), "parallel_tool_calls"),
        (json!({"messages": [{"role": "tool", "content": "42"}], "tools": [tool]}), "messages"),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]}),
            "messages",
        ),
        // A forced call needs a schema the grammar compiler takes, and no guided decoding.
        (
            json!({"messages": user, "tool_choice": "required", "tools": [{"function": {"name": "f", "parameters":
                {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 3}}, "required": ["n"]}}}]}),
            "tools",
        ),
        (
            json!({"messages": user, "tools": [tool], "tool_choice": "required", "guided_regex": "[a-z]+"}),
            "tool_choice",
        ),
    ] {
        let (status, reply) = post_json(&cluster.url("/v1/chat/completions"), &body);
        assert_eq!(status, 400, "{body}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{body}: {reply}");
        assert_eq!(reply["error"]["type"], "invalid_request_error", "{reply}");
    }
    // Completions has no tools.
    let (status, reply) =
        post_json(&cluster.url("/v1/completions"), &json!({"prompt": "hi", "tools": [weather_tool()]}));
    assert_eq!((status, reply["error"]["param"].as_str()), (400, Some("tools")), "{reply}");
    // The server still answers.
    let (status, _) = post_json(&cluster.url("/v1/chat/completions"), &json!({"messages": user, "max_tokens": 2}));
    assert_eq!(status, 200);
}

#[test]
fn a_template_without_a_call_format_needs_the_flag() {
    let user = json!([{"role": "user", "content": "hi"}]);
    let body =
        |choice: &str| json!({"messages": user, "tools": [weather_tool()], "tool_choice": choice, "max_tokens": 2});
    // tiny-qwen3's own template shows no tool-call markers.
    let plain = Coordinator::start("tiny-qwen3", 1, &[]);
    let (status, reply) = post_json(&plain.url("/v1/chat/completions"), &body("auto"));
    assert_eq!((status, reply["error"]["param"].as_str()), (400, Some("tool_choice")), "{reply}");
    assert!(reply["error"]["message"].as_str().is_some_and(|m| m.contains("--tool-call-parser")), "{reply}");
    let (status, reply) = post_json(&plain.url("/v1/chat/completions"), &body("none"));
    assert_eq!(status, 200, "{reply}");
    // No tool_choice is auto: the tools are what cannot be served.
    let implicit = json!({"messages": user, "tools": [weather_tool()], "max_tokens": 2});
    let (status, reply) = post_json(&plain.url("/v1/chat/completions"), &implicit);
    assert_eq!((status, reply["error"]["param"].as_str()), (400, Some("tools")), "{reply}");
    drop(plain);
    let flagged = Coordinator::start("tiny-qwen3", 1, &["--tool-call-parser", "llama3_json"]);
    let (status, reply) = post_json(&flagged.url("/v1/chat/completions"), &body("auto"));
    assert_eq!(status, 200, "{reply}");
}

/// A call's arguments, parsed, checked against [`weather_tool`]'s schema.
fn check_weather_arguments(arguments: &Value) {
    let arguments: Value = serde_json::from_str(arguments.as_str().expect("arguments are JSON text")).expect("JSON");
    let city = arguments["city"].as_str().expect("city");
    assert!(["Paris", "Zurich", "Lima"].contains(&city), "{arguments}");
    let days = arguments["days"].as_i64().expect("days");
    assert!((1..=7).contains(&days), "{arguments}");
    assert_eq!(arguments.as_object().map(|o| o.len()), Some(2), "{arguments}");
}

/// One forced call, whole and streamed: the stream's pieces add up to the
/// whole reply's call (the same seed and temperature 0).
fn forced_call_whole_and_streamed(cluster: &Coordinator, choice: Value, expected_name: Option<&str>) {
    let body = json!({
        "messages": [{"role": "user", "content": "What's the weather like?"}],
        "tools": [weather_tool(), time_tool()], "tool_choice": choice, "parallel_tool_calls": false,
        "max_tokens": 120, "temperature": 0,
    });
    let (status, reply) = post_json(&cluster.url("/v1/chat/completions"), &body);
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{reply}");
    let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{reply}");
    let call = &calls[0];
    assert!(call["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{call}");
    assert_eq!(call["type"], "function");
    let name = call["function"]["name"].as_str().expect("name");
    if let Some(expected) = expected_name {
        assert_eq!(name, expected);
    }
    if name == "get_weather" {
        check_weather_arguments(&call["function"]["arguments"]);
    }
    assert!(choice["message"]["content"].is_null(), "{reply}");

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let (chunks, done) = post_sse(&cluster.url("/v1/chat/completions"), &stream_body);
    assert!(done);
    let deltas: Vec<&Value> =
        chunks.iter().flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array()).flatten().collect();
    let first = deltas.first().expect("a tool-call delta");
    assert_eq!((first["index"].as_u64(), first["type"].as_str()), (Some(0), Some("function")), "{first}");
    assert!(first["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{first}");
    assert_eq!(first["function"]["name"], name);
    assert!(deltas[1..].iter().all(|d| d.get("id").is_none() && d["function"].get("name").is_none()));
    let arguments: String = deltas.iter().map(|d| d["function"]["arguments"].as_str().expect("fragment")).collect();
    assert_eq!(arguments, call["function"]["arguments"].as_str().expect("arguments"));
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, "", "no markup leaks as content");
    let last = chunks.iter().rev().find(|c| !c["choices"][0]["finish_reason"].is_null()).expect("a last chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
}

#[test]
fn required_and_named_calls_are_forced_hermes() {
    let model = model_with_template("tools-forced", &qwen25_template());
    let cluster = start(&model.0, &[]);
    forced_call_whole_and_streamed(&cluster, json!("required"), None);
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    forced_call_whole_and_streamed(&cluster, named, Some("get_weather"));
    // Parallel calls: one or more, each complete and valid unless cut by max_tokens.
    let body = json!({
        "messages": [{"role": "user", "content": "Weather?"}], "tools": [weather_tool()],
        "tool_choice": "required", "max_tokens": 200, "seed": 3,
    });
    let (status, reply) = post_json(&cluster.url("/v1/chat/completions"), &body);
    assert_eq!(status, 200, "{reply}");
    let choice = &reply["choices"][0];
    let calls = choice["message"]["tool_calls"].as_array().expect("tool_calls");
    let complete = if choice["finish_reason"] == "length" { calls.len() - 1 } else { calls.len() };
    assert!(!calls.is_empty(), "{reply}");
    for call in &calls[..complete] {
        check_weather_arguments(&call["function"]["arguments"]);
    }
}

#[test]
fn required_and_named_calls_are_forced_llama3_json() {
    let model = model_with_template("tools-llama", LLAMA31_TEMPLATE);
    let cluster = start(&model.0, &[]);
    let tools = [weather_tool()];
    let prompt = rendered(&cluster, &history()[1..], &tools);
    assert!(
        prompt.contains("{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"days\": 1}}"),
        "{prompt}"
    );
    forced_call_whole_and_streamed(&cluster, json!("required"), None);
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    forced_call_whole_and_streamed(&cluster, named, Some("get_time"));
}

/// The official openai client (create, stream, `parse` with a pydantic
/// tool) and langchain-openai (`bind_tools`, `with_structured_output`).
#[test]
fn openai_and_langchain_clients_call_tools() {
    let Some(python) = test_python("`openai` and `langchain-openai`") else { return };
    let model = model_with_template("tools-python", &qwen25_template());
    let cluster = start(&model.0, &[]);
    run_python_client(&python, "tool_calls.py", &cluster.url("/v1"), "tiny-tools", "tool calls: ok");
}
