//! Helpers for tinyvllm's end-to-end tests: they run the real binaries, as a
//! user would, against the real models in ../shared/models.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// `../shared` beside the repository.
pub fn shared() -> PathBuf {
    repo_root().join("../shared")
}

pub fn model_dir(name: &str) -> PathBuf {
    shared().join("models").join(name)
}

/// Path to a workspace binary, built (once per test process) with the same
/// profile as the tests. Cargo releases its build lock before running tests,
/// so building from inside a test is safe.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .current_dir(repo_root())
            .args(["build", "--bin", "tinyvllm-worker", "--bin", "tinyvllm-coordinator"])
            .status()
            .expect("running cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
    });
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    target.join("debug").join(name)
}

/// A golden file of ../shared/golden as JSON.
pub fn golden(file: &str) -> serde_json::Value {
    let path = shared().join("golden").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden JSON")
}
