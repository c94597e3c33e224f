//! The official `openai` Python client against a running cluster:
//! models, completions, chat, streaming, logit_bias, errors. `.ci/run` installs the
//! client in a virtual environment and points TINYVLLM_TEST_PYTHON at it.

use std::process::Command;

use tinyvllm_tests::{Coordinator, repo_root};

#[test]
fn the_openai_python_client_works() {
    let Some(python) = std::env::var_os("TINYVLLM_TEST_PYTHON") else {
        // CI must run this; a developer without the venv is told how.
        assert!(std::env::var_os("CI").is_none(), "TINYVLLM_TEST_PYTHON is not set in CI (.ci/run sets it)");
        eprintln!("skipping: set TINYVLLM_TEST_PYTHON to a python with `openai` installed (see .ci/run)");
        return;
    };
    // tiny-qwen3 has a chat template.
    let cluster = Coordinator::start("tiny-qwen3", 1, &[]);
    let out = Command::new(python)
        .arg(repo_root().join("tests/python/openai_client.py"))
        .arg(cluster.url("/v1"))
        .arg("tiny-qwen3")
        .output()
        .expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai client failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("openai client: ok"), "{stdout}");
}
