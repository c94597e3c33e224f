//! `tinyvllm-worker generate`, run as a user runs it.

use std::process::Command;

use tinyvllm_tests::{binary, golden, model_dir, plan_device};

fn generate(args: &[&str]) -> std::process::Output {
    Command::new(binary("tinyvllm-worker")).arg("generate").args(args).output().expect("running tinyvllm-worker")
}

#[test]
fn generate_json_reproduces_the_golden_tokens() {
    let golden = golden("stories260K.json");
    let case = golden["cases"].as_array().unwrap().iter().find(|c| c["id"] == "once_upon").unwrap();
    let model = model_dir("stories260K");
    let out = generate(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        case["prompt_text"].as_str().unwrap(),
        "--max-tokens",
        "48",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result["token_ids"], case["generated_ids"]);
    assert_eq!(result["text"], case["generated_text"]);
}

/// `generate --device metal-emulated`: the Metal step plan, every dispatch
/// run in the emulator, from the command line. Two cases of each family
/// here; worker/tests/golden.rs runs every case on the same device.
#[test]
fn generate_on_metal_emulated_reproduces_the_golden_tokens() {
    for file in ["stories260K", "tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-chat"] {
        let golden = golden(&format!("{file}.json"));
        let model = model_dir(golden["model"].as_str().unwrap());
        for case in golden["cases"].as_array().unwrap().iter().take(2) {
            let ids: Vec<String> =
                case["prompt_ids"].as_array().unwrap().iter().map(|id| id.as_u64().unwrap().to_string()).collect();
            let n = case["generated_ids"].as_array().unwrap().len().to_string();
            let out = generate(&[
                "--model",
                model.to_str().unwrap(),
                "--device",
                plan_device(),
                "--prompt-token-ids",
                &ids.join(","),
                "--max-tokens",
                &n,
                "--temperature",
                "0",
                "--ignore-eos",
                "--json",
            ]);
            assert!(out.status.success(), "{file}: {}", String::from_utf8_lossy(&out.stderr));
            let result: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(result["token_ids"], case["generated_ids"], "{file} case {}", case["id"]);
        }
    }
}

#[test]
fn generate_streams_text_from_token_ids() {
    let model = model_dir("stories260K");
    let out = generate(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt-token-ids",
        "1,403,407,261,378",
        "--max-tokens",
        "20",
        "--temperature",
        "0",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.starts_with(", there was a little girl named Lily"), "{text:?}");
}

#[test]
fn bad_models_fail_with_a_clear_message() {
    let out = generate(&["--model", "/nonexistent/model", "--prompt", "hi"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let dir = std::env::temp_dir().join(format!("tinyvllm-badarch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"architectures":["GPT2LMHeadModel"],"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2,"vocab_size":4}"#).unwrap();
    let out = generate(&["--model", dir.to_str().unwrap(), "--prompt", "hi"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("GPT2LMHeadModel"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_tensor_is_named() {
    // A config that asks for 6 layers of stories260K's 5: layer 5 is missing.
    let dir = std::env::temp_dir().join(format!("tinyvllm-missing-tensor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = model_dir("stories260K");
    let config = std::fs::read_to_string(src.join("config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&config).unwrap();
    config["num_hidden_layers"] = 6.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let out = generate(&["--model", dir.to_str().unwrap(), "--prompt-token-ids", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("model.layers.5"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
