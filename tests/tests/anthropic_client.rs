//! The official `anthropic` Python client against a running cluster
//! (`/v1/messages`, what Claude Code speaks): create, stream, forced tool
//! use created and streamed, a tool result sent back, count_tokens, and
//! errors in Anthropic's shape. `.ci/run` installs the client in the
//! virtual environment TINYVLLM_TEST_PYTHON points at.

use tinyvllm_tests::{Coordinator, run_python_client, test_python};

#[test]
fn the_anthropic_python_client_works() {
    let Some(python) = test_python("`anthropic`") else { return };
    // tiny-qwen3 has a chat template; its calls are read as Hermes' JSON,
    // and with an API key the client's x-api-key header must carry it.
    let cluster = Coordinator::start("tiny-qwen3", 1, &["--tool-call-parser", "hermes", "--api-key", "test-key"]);
    run_python_client(&python, "anthropic_client.py", &cluster.url(""), "tiny-qwen3", "anthropic client: ok");
}
