//! Replays the checked-in fuzz corpus (`fuzz/corpus/<target>/`) through the
//! same entry points the cargo-fuzz targets call, so every input the fuzzer
//! kept (seeds, minimized coverage, regressions) is rerun by `cargo test` on
//! stable Rust. `write_seeds` (ignored) writes the seed inputs, made from
//! the golden files and realistic requests; `tools/fuzz.sh` does the fuzzing.

use std::path::{Path, PathBuf};

use coordinator::fuzzing::{self, ChatInput, DetokInput, StopSpec};
use serde_json::{Value, json};

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 4] = [
    ("wire_frame", fuzzing::wire_frame),
    ("http_request", fuzzing::http_request),
    ("detokenizer", fuzzing::detokenizer),
    ("chat_template", fuzzing::chat_template),
];

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(target)
}

fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

fn replay(target: &str) {
    let (_, run) = TARGETS.iter().find(|(name, _)| *name == target).expect("a target");
    let files = corpus(target);
    assert!(files.len() >= 10, "{target}: only {} corpus files", files.len());
    for file in files {
        let data = std::fs::read(&file).expect("read a corpus file");
        // Shown when the test fails: the input that broke an invariant.
        eprintln!("{}", file.display());
        run(&data);
    }
}

#[test]
fn wire_frame_corpus() {
    replay("wire_frame");
    for seed in fuzzing::wire_seeds() {
        fuzzing::wire_frame(&seed);
    }
}

#[test]
fn http_request_corpus() {
    replay("http_request");
}

#[test]
fn detokenizer_corpus() {
    replay("detokenizer");
}

#[test]
fn chat_template_corpus() {
    replay("chat_template");
}

#[test]
fn detok_input_round_trips() {
    let input = DetokInput {
        model: 4,
        skip_special_tokens: false,
        stops: vec![StopSpec::Text(b"\n\n".to_vec()), StopSpec::Tokens { start: 3, len: 2 }],
        prompt: vec![1, 2, 3],
        steps: vec![vec![10], vec![11, 12, 31999]],
    };
    assert_eq!(DetokInput::parse(&input.to_bytes()), input);
}

fn golden(name: &str) -> Value {
    let path = fuzzing::test_data_dir().join("golden").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).expect("golden file")).expect("golden json")
}

fn ids(value: &Value) -> Vec<u32> {
    value.as_array().into_iter().flatten().filter_map(Value::as_u64).map(|id| id as u32).collect()
}

/// Conversations for the chat and HTTP seeds.
fn conversations() -> Vec<Value> {
    let mut all: Vec<Value> = golden("tiny-qwen3-chat.json")["cases"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c["messages"].clone())
        .collect();
    all.extend([
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Zürich?"},
               {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"}]),
        json!([{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]),
        json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        json!([{"role": "assistant", "content": "  spaced  "}, {"role": "user"}]),
        json!(["hi", {"content": "no role"}, {"role": 3}]),
    ]);
    all
}

fn write(target: &str, name: String, bytes: &[u8]) {
    let dir = corpus_dir(target);
    std::fs::create_dir_all(&dir).expect("corpus dir");
    std::fs::write(dir.join(name), bytes).expect("write a seed");
}

/// `cargo test -p tinyvllm-coordinator --test fuzz_corpus -- --ignored write_seeds`
#[test]
#[ignore = "writes the seed corpus"]
fn write_seeds() {
    for (i, seed) in fuzzing::wire_seeds().iter().enumerate() {
        write("wire_frame", format!("seed-{i:02}"), seed);
    }

    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    for (i, messages) in conversations().iter().enumerate() {
        for template in 0..4u8 {
            let body = json!({"messages": messages, "add_generation_prompt": template % 2 == 0,
                "tools": if template == 1 { tools.clone() } else { Value::Null },
                "chat_template_kwargs": {"enable_thinking": false, "date_string": "1 Jan 2026"}});
            write("chat_template", format!("seed-{i:02}-{template}"), &ChatInput { template, body }.to_bytes());
        }
    }

    let bodies = [
        json!({"prompt": "Once upon a time", "max_tokens": 16}),
        json!({"prompt_token_ids": [1, 415, 2936], "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 7,
               "logprobs": 2, "prompt_logprobs": 1, "stream": true}),
        json!({"prompt": "Hi", "prompt_token_ids": [1]}),
        json!({"model": "tiny-qwen3", "prompt": ["a", "b"], "n": 2, "echo": true, "logprobs": 1, "max_tokens": 0}),
        json!({"model": "other", "prompt": [[1, 2], [3]], "stop": ["\n", "END"], "stop_token_ids": [2]}),
        json!({"prompt": "x", "max_tokens": 2000, "min_tokens": 3, "top_k": -1, "min_p": 0.1,
               "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1,
               "logit_bias": {"50": -100, "9": 2.5}, "ignore_eos": true, "stream": false,
               "stream_options": {"include_usage": true}}),
        json!({"prompt": "x", "temperature": 1e308, "response_format": {"type": "json_object"}, "best_of": 3,
               "suffix": "s"}),
        json!({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8,
               "logprobs": true, "top_logprobs": 3, "stream": true, "stream_options": {"include_usage": true}}),
        json!({"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}]}),
        json!({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "t"}]}],
               "max_completion_tokens": 4, "top_logprobs": 2}),
        json!({"prompt": [99999999], "max_tokens": -1}),
        json!({"prompt": ""}),
        json!(null),
        json!([1, 2, 3]),
    ];
    for (i, body) in bodies.iter().enumerate() {
        write("http_request", format!("seed-{i:02}"), body.to_string().as_bytes());
    }
    write("http_request", "seed-broken".into(), b"{\"prompt\": \"unterminated");

    let stops = [b"\n\n".to_vec(), b" the".to_vec(), "猫".as_bytes().to_vec(), b"vid".to_vec()];
    let mut n = 0;
    for (model, file) in fuzzing::MODELS.iter().enumerate() {
        let file = format!("{file}.json");
        let Some(cases) = golden(&file)["cases"].as_array().cloned() else { continue };
        for (c, case) in cases.iter().take(3).enumerate() {
            let prompt = ids(&case["prompt_ids"]);
            let generated: Vec<u32> = ids(&case["generated_ids"]).into_iter().take(24).collect();
            let steps: Vec<Vec<u32>> = generated.chunks(1 + c).map(<[u32]>::to_vec).collect();
            let input = DetokInput {
                model,
                skip_special_tokens: c != 1,
                stops: vec![StopSpec::Text(stops[c % stops.len()].clone()), StopSpec::Tokens { start: 5, len: 2 }],
                prompt: prompt.iter().rev().take(20).rev().copied().collect(),
                steps,
            };
            write("detokenizer", format!("seed-{n:02}"), &input.to_bytes());
            n += 1;
        }
    }
}
