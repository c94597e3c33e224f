//! The coordinator's page at `/` end to end, in a real browser (headless
//! Chromium driven by Playwright, tests/browser/page.mjs): it asks for the
//! API key the coordinator was started with, shows the cluster (a local
//! pipeline of two stages and a second worker), streams a completion from
//! the built-in model, and drops a worker that was killed. Screenshots go
//! to target/test-artifacts/web-page/.
//!
//! `.ci/run` installs Chromium and playwright-core and sets
//! TINYVLLM_TEST_BROWSER to the directory holding playwright-core's
//! node_modules; without it the test skips, except under CI, where it fails.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use tinyvllm_tests::{Coordinator, repo_root};

#[test]
fn the_page_chats_and_shows_the_cluster() {
    let Some(node_modules) = std::env::var_os("TINYVLLM_TEST_BROWSER") else {
        assert!(std::env::var_os("CI").is_none(), "TINYVLLM_TEST_BROWSER is not set in CI (.ci/run sets it)");
        eprintln!("skipping: set TINYVLLM_TEST_BROWSER to a directory with node_modules/playwright-core (see .ci/run)");
        return;
    };
    let cluster = Coordinator::start_pipelines("stories260K", 1, 2, &["--api-key", "page-key"]);
    let mut extra = cluster.start_worker("stories260K", "extra", &cluster.secret_file);
    cluster.wait_for_workers(2);

    // The page's files are public; the API behind them is not.
    let page = ureq::get(&cluster.url("/")).call().expect("GET /");
    assert_eq!(page.header("content-type"), Some("text/html; charset=utf-8"));
    assert!(page.into_string().expect("html").contains("/ui/app.js"));
    let status = match ureq::get(&cluster.url("/v1/workers")).call() {
        Err(ureq::Error::Status(code, _)) => code,
        other => panic!("{other:?}"),
    };
    assert_eq!(status, 401);

    let shots = repo_root().join("target/test-artifacts/web-page");
    std::fs::create_dir_all(&shots).expect("screenshot dir");
    let mut node = Command::new("node")
        .arg(repo_root().join("tests/browser/page.mjs"))
        .args([cluster.url("/").as_str(), "page-key", shots.to_str().expect("path")])
        .env("TINYVLLM_TEST_BROWSER", &node_modules)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("node");
    let mut stdin = Some(node.stdin.take().expect("stdin"));
    let stdout = BufReader::new(node.stdout.take().expect("stdout"));
    let mut said = Vec::new();
    for line in stdout.lines() {
        let line = line.expect("line");
        if line == "kill extra" {
            extra.kill().expect("kill");
            let mut pipe = stdin.take().expect("stdin");
            writeln!(pipe, "killed").expect("tell the page script");
        }
        said.push(line);
    }
    // Killed above when the script asked; reaped here in any case.
    let _ = extra.kill();
    extra.wait().expect("the extra worker exits");
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut node.stderr.take().expect("stderr"), &mut stderr).expect("stderr");
    let status = node.wait().expect("node exit");
    assert!(status.success() && said.last().is_some_and(|l| l == "ok"), "page script: {said:?}\n{stderr}");
    assert!(shots.join("page-worker-left.png").is_file());
}
