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
