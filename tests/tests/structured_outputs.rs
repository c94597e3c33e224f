//! Structured outputs end to end: a real coordinator and worker serving
//! tiny-qwen3, whose weights are random, so unconstrained output is
//! garbage and only the grammar mask can make it parse. Covers
//! `response_format` (json_object, json_schema), vLLM's `structured_outputs`
//! and `guided_*` (regex, choice, Lark grammar with an embedded schema),
//! streaming and not, `/generate`, several temperatures and seeds with a
//! stop string, and the 400s for constraints the compiler rejects and for
//! two constraints at once. The python clients (openai's `parse`,
//! langchain's `with_structured_output`, `jsonschema` validation) are
//! driven from `tests/python/structured_outputs.py`.

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, post_json, post_sse, run_python_client, test_python};

const MODEL: &str = "tiny-qwen3";

/// A schema whose every valid instance is short, so greedy and sampled
/// runs end (with EOS) well inside `max_tokens`.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "mood": {"enum": ["happy", "sad"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}
        },
        "required": ["name", "age", "mood"],
        "additionalProperties": false
    })
}

/// `text` as `person_schema` requires it, checked by hand.
fn assert_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    assert!(o.keys().all(|k| ["name", "age", "mood", "tags"].contains(&k.as_str())), "{text}");
    assert!(o["name"].as_str().is_some_and(|n| n.chars().count() <= 8), "{text}");
    assert!(o["age"].as_u64().is_some_and(|a| a <= 150), "{text}");
    assert!(["happy", "sad"].contains(&o["mood"].as_str().unwrap_or("")), "{text}");
    if let Some(tags) = o.get("tags") {
        let tags = tags.as_array().unwrap_or_else(|| panic!("tags: {text}"));
        assert!(tags.len() <= 2 && tags.iter().all(|t| t.as_str().is_some_and(|t| t.chars().count() <= 4)), "{text}");
    }
}

fn chat(cluster: &Coordinator, extra: Value) -> Value {
    let mut body =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 200});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let (status, reply) = post_json(&cluster.url("/v1/chat/completions"), &body);
    assert_eq!(status, 200, "{reply}");
    reply
}

fn content_and_finish(reply: &Value) -> (String, String) {
    let choice = &reply["choices"][0];
    (choice["message"]["content"].as_str().unwrap().to_string(), choice["finish_reason"].as_str().unwrap().to_string())
}

#[test]
fn constrained_output_parses_at_any_temperature_streaming_or_not() {
    let cluster = Coordinator::start(MODEL, 1, &[]);
    let format =
        json!({"type": "json_schema", "json_schema": {"name": "person", "schema": person_schema(), "strict": true}});
    for (temperature, seed) in [(0.0, 0), (0.7, 1), (1.0, 2), (1.5, 3), (2.0, 4)] {
        let reply = chat(
            &cluster,
            json!({"response_format": format, "temperature": temperature, "seed": seed, "stop": ["\n"]}),
        );
        let (text, finish) = content_and_finish(&reply);
        assert_eq!(finish, "stop", "T={temperature}: {text}");
        assert_person(&text);
    }

    // Streamed: the deltas join into the same valid document.
    let body = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 200,
        "temperature": 0, "stream": true, "response_format": format,
    });
    let (events, done) = post_sse(&cluster.url("/v1/chat/completions"), &body);
    assert!(done);
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    assert_person(&text);
    let greedy = content_and_finish(&chat(&cluster, json!({"response_format": format, "temperature": 0}))).0;
    assert_eq!(text, greedy);

    // Any JSON object (json_object), on chat and on completions.
    let (text, finish) =
        content_and_finish(&chat(&cluster, json!({"response_format": {"type": "json_object"}, "temperature": 0})));
    assert!(text.starts_with('{'), "{text}");
    if finish == "stop" {
        assert!(serde_json::from_str::<Value>(&text).unwrap().is_object(), "{text}");
    }
    let body =
        json!({"model": MODEL, "prompt": "JSON:", "max_tokens": 200, "temperature": 0, "response_format": format});
    let (status, reply) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 200, "{reply}");
    assert_person(reply["choices"][0]["text"].as_str().unwrap());

    // Cut by max_tokens: finish_reason length, as vLLM (the text is a prefix).
    let reply = chat(&cluster, json!({"response_format": format, "temperature": 0, "max_tokens": 3}));
    assert_eq!(content_and_finish(&reply).1, "length");
}

#[test]
fn regex_choice_and_grammar_constrain_every_endpoint() {
    let cluster = Coordinator::start(MODEL, 1, &[]);
    let is_code = |t: &str| {
        let (digits, letters) = t.split_once('-').unwrap_or(("", ""));
        digits.len() == 3
            && digits.bytes().all(|b| b.is_ascii_digit())
            && (2..=4).contains(&letters.len())
            && letters.bytes().all(|b| b.is_ascii_lowercase())
    };
    let regex = r"[0-9]{3}-[a-z]{2,4}";
    for (seed, field) in [(1, json!({"guided_regex": regex})), (2, json!({"structured_outputs": {"regex": regex}}))] {
        let (text, finish) =
            content_and_finish(&chat(&cluster, json!({"temperature": 1.0, "seed": seed}).merge(field)));
        assert!(is_code(&text) && finish == "stop", "{text:?} {finish}");
    }

    let choices = ["red", "green", "light blue"];
    for seed in 0..4 {
        let (text, _) =
            content_and_finish(&chat(&cluster, json!({"guided_choice": choices, "temperature": 1.5, "seed": seed})));
        assert!(choices.contains(&text.as_str()), "{text:?}");
    }

    // Lark, with a JSON schema embedded as the tool-calling grammars do.
    let grammar = r#"start: "age=" %json{"type": "integer", "minimum": 1, "maximum": 99} ";""#;
    let (text, _) =
        content_and_finish(&chat(&cluster, json!({"guided_grammar": grammar, "temperature": 0.8, "seed": 5})));
    let age: u32 =
        text.strip_prefix("age=").and_then(|t| t.strip_suffix(';')).and_then(|t| t.parse().ok()).unwrap_or(0);
    assert!((1..=99).contains(&age), "{text:?}");

    // /generate with guided_* and structured_outputs, streamed and not.
    let url = cluster.url("/generate");
    let body = json!({"prompt": "Pick:", "max_tokens": 50, "temperature": 1.0, "seed": 9, "guided_choice": choices});
    let (status, reply) = post_json(&url, &body);
    assert_eq!(status, 200, "{reply}");
    assert!(choices.contains(&reply["text"].as_str().unwrap()), "{reply}");
    let body = json!({"prompt": "Person:", "max_tokens": 200, "temperature": 0.5, "seed": 3, "stream": true,
                      "guided_json": person_schema()});
    let (events, done) = post_sse(&url, &body);
    assert!(done);
    assert_person(&events.iter().filter_map(|e| e["text"].as_str()).collect::<String>());
    let body = json!({"prompt": "Person:", "max_tokens": 200, "temperature": 0,
                      "structured_outputs": {"json": person_schema().to_string()}});
    let (status, reply) = post_json(&url, &body);
    assert_eq!(status, 200, "{reply}");
    assert_person(reply["text"].as_str().unwrap());
}

#[test]
fn constraints_the_compiler_rejects_get_a_400_naming_the_field() {
    let cluster = Coordinator::start(MODEL, 1, &[]);
    let messages = json!([{"role": "user", "content": "hi"}]);
    for (path, field, param) in [
        (
            "/v1/chat/completions",
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 3}}}}),
            "response_format",
        ),
        (
            "/v1/chat/completions",
            json!({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}),
            "guided_json",
        ),
        ("/v1/completions", json!({"guided_regex": "(unclosed"}), "guided_regex"),
        ("/generate", json!({"guided_grammar": "start: missing_rule"}), "guided_grammar"),
        ("/generate", json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
        (
            "/v1/chat/completions",
            json!({"response_format": {"type": "json_object"}, "guided_regex": "a+"}),
            "guided_regex",
        ),
    ] {
        let body = json!({"model": MODEL, "messages": messages, "prompt": "hi", "max_tokens": 4}).merge(field.clone());
        let (status, reply) = post_json(&cluster.url(path), &body);
        assert_eq!(status, 400, "{path} {field}: {reply}");
        assert_eq!(reply["error"]["param"], param, "{reply}");
        assert_eq!(reply["error"]["type"], "invalid_request_error", "{reply}");
    }
    // The cluster still serves afterwards.
    let (status, _) = post_json(&cluster.url("/generate"), &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(status, 200);
}

/// The openai client's `chat.completions.parse` with a pydantic model and
/// langchain-openai's `with_structured_output`, validated with `jsonschema`.
#[test]
fn the_python_clients_get_validated_structured_output() {
    let Some(python) = test_python("openai, langchain-openai and jsonschema") else { return };
    let cluster = Coordinator::start(MODEL, 1, &[]);
    run_python_client(&python, "structured_outputs.py", &cluster.url("/v1"), MODEL, "structured outputs: ok");
}

/// `a` with `b`'s fields added.
trait Merge {
    fn merge(self, b: Value) -> Value;
}

impl Merge for Value {
    fn merge(mut self, b: Value) -> Value {
        if let (Some(a), Value::Object(b)) = (self.as_object_mut(), b) {
            a.extend(b);
        }
        self
    }
}
