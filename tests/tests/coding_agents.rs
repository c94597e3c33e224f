//! Coding agents, the real ones, against a running cluster: Claude Code
//! (`@anthropic-ai/claude-code`, `claude -p`) over `/v1/messages`, and
//! Codex CLI (`@openai/codex`, `codex exec` with a model provider whose
//! `wire_api` is `responses`) over `/v1/responses`. `.ci/run` installs both
//! from npm and points TINYVLLM_TEST_CLAUDE and TINYVLLM_TEST_CODEX at them.
//! Codex sends a streamed request with developer messages, function tools,
//! a `namespace` group and a hosted `web_search` tool (left out), `store:
//! false` and `reasoning`.
//!
//! Claude Code sends what it sends to Anthropic: a ~35k-token prompt (three
//! system blocks, two dozen tools), `max_tokens: 32000`, `thinking`,
//! `context_management`, `output_config`, streamed, with `x-api-key`. The
//! model is tiny-qwen3 given a context of 65536 positions (RoPE has no
//! limit; the config's is 1024) and, since random weights never choose
//! EOS, half of its vocabulary as end-of-turn tokens, so each reply is a
//! token or two and ends its turn, as an answer does.

use std::process::Command;

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, TempDir, model_dir};

/// tiny-qwen3 with a long context and turns that end (see above).
fn agent_model() -> TempDir {
    let dir = TempDir::new("agent-model");
    let source = model_dir("tiny-qwen3");
    for entry in std::fs::read_dir(&source).expect("model dir") {
        let name = entry.expect("entry").file_name();
        if name != "config.json" && name != "generation_config.json" {
            std::os::unix::fs::symlink(source.join(&name), dir.0.join(&name)).expect("link");
        }
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).expect("config")).expect("json");
    config["max_position_embeddings"] = json!(65536);
    std::fs::write(dir.0.join("config.json"), config.to_string()).expect("write config");
    let vocab = config["vocab_size"].as_u64().expect("vocab_size");
    let eos: Vec<u64> = std::iter::once(2).chain((4..vocab).step_by(2)).collect();
    let generation = json!({"bos_token_id": 1, "eos_token_id": eos, "do_sample": false});
    std::fs::write(dir.0.join("generation_config.json"), generation.to_string()).expect("write generation config");
    dir
}

/// An agent's CLI from `variable`, or None outside CI when it is not installed.
fn agent(variable: &str, package: &str) -> Option<std::ffi::OsString> {
    let cli = std::env::var_os(variable);
    if cli.is_none() {
        assert!(std::env::var_os("CI").is_none(), "{variable} is not set in CI (.ci/run sets it)");
        eprintln!("skipping: set {variable} to the CLI of npm's {package}");
    }
    cli
}

/// A cluster serving [`agent_model`] as `tiny-qwen3`, behind an API key.
fn agent_cluster(model: &TempDir) -> Coordinator {
    let args = [
        "--served-model-name",
        "tiny-qwen3",
        "--tool-call-parser",
        "hermes",
        "--api-key",
        "test-key",
        // A reply that does not end is cut here (Claude Code asks for 32000).
        "--max-tokens-cap",
        "64",
    ];
    Coordinator::start(model.0.to_str().expect("utf-8 path"), 1, &args)
}

/// Checks an agent's run: exit 0, no API error, and `endpoint` answered.
fn check_turn(cluster: &Coordinator, out: &std::process::Output, endpoint: &str) {
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the agent exited with {}:\n{stdout}\n{stderr}", out.status);
    for text in [&stdout, &stderr] {
        assert!(!text.contains("API Error") && !text.contains("ERROR:"), "{stdout}\n{stderr}");
    }
    let served = metric(cluster, &format!(r#"tinyvllm_http_requests_total{{endpoint="{endpoint}",status="200"}}"#));
    assert!(served >= 1.0, "no {endpoint} request was answered: {stdout}\n{stderr}");
}

fn metric(cluster: &Coordinator, line_start: &str) -> f64 {
    let text = ureq::get(&cluster.url("/metrics")).call().expect("metrics").into_string().expect("text");
    text.lines().find_map(|l| l.strip_prefix(line_start).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

#[test]
fn claude_code_completes_a_turn() {
    let Some(claude) = agent("TINYVLLM_TEST_CLAUDE", "@anthropic-ai/claude-code") else { return };
    let model = agent_model();
    let cluster = agent_cluster(&model);
    let home = TempDir::new("claude-home");
    let out = Command::new(&claude)
        .args(["-p", "Say hello"])
        .env("HOME", &home.0)
        .env("ANTHROPIC_BASE_URL", cluster.url(""))
        .env("ANTHROPIC_API_KEY", "test-key")
        .env("ANTHROPIC_MODEL", "tiny-qwen3")
        .env("ANTHROPIC_SMALL_FAST_MODEL", "tiny-qwen3")
        .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
        .env("DISABLE_TELEMETRY", "1")
        .env("DISABLE_AUTOUPDATER", "1")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("running claude");
    check_turn(&cluster, &out, "/v1/messages");
}

#[test]
fn codex_completes_a_turn() {
    let Some(codex) = agent("TINYVLLM_TEST_CODEX", "@openai/codex") else { return };
    let model = agent_model();
    let cluster = agent_cluster(&model);
    let home = TempDir::new("codex-home");
    let config = format!(
        "model = \"tiny-qwen3\"\nmodel_provider = \"tinyvllm\"\n\n[model_providers.tinyvllm]\nname = \"tinyvllm\"\n\
         base_url = \"{}\"\nenv_key = \"TINYVLLM_API_KEY\"\nwire_api = \"responses\"\n",
        cluster.url("/v1")
    );
    std::fs::write(home.0.join("config.toml"), config).expect("codex config");
    let work = TempDir::new("codex-work");
    let out = Command::new(&codex)
        .args(["exec", "--skip-git-repo-check", "Say hello"])
        .current_dir(&work.0)
        .env("HOME", &home.0)
        .env("CODEX_HOME", &home.0)
        .env("TINYVLLM_API_KEY", "test-key")
        .stdin(std::process::Stdio::null())
        .output()
        .expect("running codex");
    check_turn(&cluster, &out, "/v1/responses");
}
