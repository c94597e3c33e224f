//! The official `openai` Python client against a running cluster:
//! models, completions, chat, streaming, logit_bias, errors. `.ci/run` installs the
//! client in a virtual environment and points TINYVLLM_TEST_PYTHON at it.

use tinyvllm_tests::{Coordinator, run_python_client, test_python};

#[test]
fn the_openai_python_client_works() {
    let Some(python) = test_python("`openai`") else { return };
    // tiny-qwen3 has a chat template.
    let cluster = Coordinator::start("tiny-qwen3", 1, &[]);
    run_python_client(&python, "openai_client.py", &cluster.url("/v1"), "tiny-qwen3", "openai client: ok");
}

/// OpenAI's Responses API (`/v1/responses`, what Codex CLI and the Agents
/// SDK speak) through the same client; calls read as Hermes' JSON.
#[test]
fn the_openai_responses_api_works() {
    let Some(python) = test_python("`openai`") else { return };
    let cluster = Coordinator::start("tiny-qwen3", 1, &["--tool-call-parser", "hermes"]);
    run_python_client(&python, "responses_client.py", &cluster.url("/v1"), "tiny-qwen3", "responses client: ok");
}

/// The OpenAI Agents SDK running one tool-using turn (a forced call, the
/// tool run by the SDK, its output sent back, an answer), over the
/// Responses API and over chat completions (tests/python/agents_sdk.py).
#[test]
fn the_openai_agents_sdk_completes_a_tool_turn() {
    let Some(python) = test_python("`openai-agents`") else { return };
    let cluster = Coordinator::start("tiny-qwen3", 1, &["--tool-call-parser", "hermes"]);
    run_python_client(&python, "agents_sdk.py", &cluster.url("/v1"), "tiny-qwen3", "agents sdk: ok");
}
