//! Helpers for tinyvllm's end-to-end tests: they run the real binaries, as a
//! user would, against the real models in tests/models.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub mod hub;
pub mod netem;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// The test models (`models/`) and transformers' reference outputs (`golden/`), in the repository's `tests/`.
pub fn test_data() -> PathBuf {
    repo_root().join("tests")
}

pub fn model_dir(name: &str) -> PathBuf {
    test_data().join("models").join(name)
}

/// Path to a workspace binary, built (once per test process) with the same
/// profile as the tests. Cargo releases its build lock before running tests,
/// so building from inside a test is safe.
pub fn binary(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut command = Command::new(cargo);
        // The package variables cargo set for this test process: build
        // scripts (ring's) watch them, and seeing them here would rebuild
        // ring and everything above it, again after every plain `cargo build`.
        for (name, _) in std::env::vars_os() {
            let name = name.to_string_lossy();
            if name.starts_with("CARGO_PKG_") || name.starts_with("CARGO_MANIFEST_") || name == "CARGO_CRATE_NAME" {
                command.env_remove(name.as_ref());
            }
        }
        let status = command
            .current_dir(repo_root())
            .args(["build", "--bin", "tinyvllm-worker", "--bin", "tinyvllm-coordinator"])
            .status()
            .expect("running cargo build");
        assert!(status.success(), "cargo build of the binaries failed");
    });
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    target.join("debug").join(name)
}

/// The `--device` of the tests that run the Metal step plan: `metal` where
/// tests run on Metal (`TINYVLLM_TEST_DEVICE=metal`, the macOS CI job),
/// `metal-emulated` (the CPU emulator of our kernels) elsewhere.
pub fn plan_device() -> &'static str {
    match std::env::var("TINYVLLM_TEST_DEVICE").as_deref() {
        Ok("metal") => "metal",
        _ => "metal-emulated",
    }
}

/// A golden file of tests/golden as JSON.
pub fn golden(file: &str) -> serde_json::Value {
    let path = test_data().join("golden").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("golden JSON")
}

/// A coordinator process on loopback (ports chosen by the OS), optionally
/// with local workers; stopped with SIGTERM (then SIGKILL) when dropped.
pub struct Coordinator {
    pub child: std::process::Child,
    pub http: String,
    pub quic: String,
    pub secret_file: PathBuf,
    _dir: TempDir,
}

/// A directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tinyvllm-{tag}-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of test model `model` (its other files linked) whose
/// tokenizer_config.json carries `template` as its chat template.
pub fn model_with_template(model: &str, tag: &str, template: &str) -> TempDir {
    let dir = TempDir::new(tag);
    let source = model_dir(model);
    for entry in std::fs::read_dir(&source).expect("model dir") {
        let name = entry.expect("entry").file_name();
        if name != "tokenizer_config.json" {
            std::os::unix::fs::symlink(source.join(&name), dir.0.join(&name)).expect("link");
        }
    }
    let config = std::fs::read_to_string(source.join("tokenizer_config.json")).expect("tokenizer_config.json");
    let mut config: serde_json::Value = serde_json::from_str(&config).expect("json");
    config["chat_template"] = serde_json::Value::String(template.to_string());
    std::fs::write(dir.0.join("tokenizer_config.json"), config.to_string()).expect("write");
    dir
}

/// A chat template published with a model family, as the repository keeps
/// it (coordinator/src/text/testdata/published).
pub fn published_template(file: &str) -> String {
    let path = repo_root().join("coordinator/src/text/testdata/published").join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A draft model for speculative decoding made from a test model: its first
/// `layers` decoder layers with its embeddings, final norm and lm_head (a
/// layer-skipping self-draft), as a directory of its own: a config.json with
/// fewer layers beside links to the model's weights and tokenizer files
/// (the loader reads only the tensors the config names).
pub fn truncated_model(name: &str, layers: usize) -> TempDir {
    let out = TempDir::new(&format!("draft-{name}"));
    let dir = model_dir(name);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).expect("config.json")).unwrap();
    common::model::truncate_layers(&mut config, layers);
    std::fs::write(out.0.join("config.json"), config.to_string()).unwrap();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().is_some_and(|f| f != "config.json") && path.is_file() {
            let target = std::fs::canonicalize(&path).unwrap();
            std::os::unix::fs::symlink(target, out.0.join(path.file_name().unwrap())).unwrap();
        }
    }
    out
}

pub fn terminate(child: &mut std::process::Child) {
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    for _ in 0..100 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl Coordinator {
    /// Starts `tinyvllm-coordinator` on `model` (a test model's name, a
    /// path, or "" for the coordinator's default) with `extra` arguments and
    /// waits until it listens (and, with local workers, until they are ready).
    pub fn start(model: &str, local_workers: usize, extra: &[&str]) -> Self {
        Self::start_wrapped(&[], model, local_workers, extra)
    }

    /// As [`Coordinator::start`], run under `wrapper` (a command and its
    /// arguments, e.g. `prlimit --nofile=128:128 --`).
    pub fn start_wrapped(wrapper: &[&str], model: &str, local_workers: usize, extra: &[&str]) -> Self {
        Self::spawn(wrapper, model, local_workers, local_workers, extra)
    }

    /// Starts a coordinator with `pipelines` local pipelines of `stages`
    /// workers each, and waits until every pipeline's first stage (the one
    /// that registers) is ready.
    pub fn start_pipelines(model: &str, pipelines: usize, stages: usize, extra: &[&str]) -> Self {
        let pp = stages.to_string();
        let mut args = vec!["--pipeline-parallel-size", pp.as_str()];
        args.extend_from_slice(extra);
        Self::spawn(&[], model, pipelines * stages, pipelines, &args)
    }

    fn spawn(wrapper: &[&str], model: &str, local_workers: usize, ready_workers: usize, extra: &[&str]) -> Self {
        let dir = TempDir::new("cluster");
        let secret_file = dir.0.join("secret");
        let coordinator = binary("tinyvllm-coordinator");
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&coordinator);
                c
            }
            None => Command::new(&coordinator),
        };
        // No model: the coordinator's default (the built-in one).
        let model_args: Vec<String> = match model {
            "" => Vec::new(),
            _ => vec!["--model".into(), model_dir(model).to_str().expect("utf-8 path").into()],
        };
        let child = command
            .args(&model_args)
            .args(["--http", "127.0.0.1:0", "--quic", "127.0.0.1:0"])
            .args(["--local-workers", &local_workers.to_string()])
            .arg("--cluster-secret-file")
            .arg(&secret_file)
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting the coordinator");
        Self::attach(child, secret_file, dir, ready_workers)
    }

    /// Reads the started coordinator's first line (its addresses) and
    /// waits for its local workers.
    fn attach(mut child: std::process::Child, secret_file: PathBuf, dir: TempDir, local_workers: usize) -> Self {
        use std::io::BufRead;
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        std::io::BufReader::new(stdout).read_line(&mut line).expect("coordinator's first line");
        let field = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .to_string()
        };
        let coordinator = Self { http: field("http="), quic: field("quic="), secret_file, child, _dir: dir };
        if local_workers > 0 {
            coordinator.wait_for_workers(local_workers);
        }
        coordinator
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    /// Waits until `n` workers are registered and ready.
    pub fn wait_for_workers(&self, n: usize) {
        // /health needs no API key and counts the registered workers.
        for _ in 0..600 {
            if let Ok(resp) = ureq::get(&self.url("/health")).call() {
                let v: serde_json::Value = resp.into_json().expect("json");
                if v["workers"].as_u64() == Some(n as u64) {
                    return;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("{n} workers never became ready");
    }

    /// Starts a worker process of our own that joins this cluster.
    pub fn start_worker(&self, model: &str, name: &str, secret_file: &Path) -> std::process::Child {
        self.start_worker_with(model, name, secret_file, &[])
    }

    /// As [`Coordinator::start_worker`], with `extra` arguments to `serve`.
    pub fn start_worker_with(
        &self,
        model: &str,
        name: &str,
        secret_file: &Path,
        extra: &[&str],
    ) -> std::process::Child {
        Command::new(binary("tinyvllm-worker"))
            .args([
                "serve",
                "--model",
                model_dir(model).to_str().expect("utf-8 path"),
                "--coordinator",
                &self.quic,
                "--name",
                name,
            ])
            .arg("--cluster-secret-file")
            .arg(secret_file)
            .args(extra)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting a worker")
    }

    pub fn workers(&self) -> serde_json::Value {
        ureq::get(&self.url("/v1/workers")).call().expect("GET /v1/workers").into_json().expect("json")
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// POSTs JSON; returns the status and the body as JSON (errors included).
pub fn post_json(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    match ureq::post(url).send_json(body.clone()) {
        Ok(resp) => (resp.status(), resp.into_json().expect("json body")),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_json().unwrap_or(serde_json::Value::Null)),
        Err(e) => panic!("POST {url}: {e}"),
    }
}

/// POSTs a streaming request; returns the `data:` payloads (without `[DONE]`)
/// and whether `[DONE]` ended the stream.
pub fn post_sse(url: &str, body: &serde_json::Value) -> (Vec<serde_json::Value>, bool) {
    use std::io::BufRead;
    let resp = ureq::post(url).send_json(body.clone()).expect("streaming POST");
    assert_eq!(resp.header("content-type"), Some("text/event-stream"));
    let mut events = Vec::new();
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line.expect("SSE line");
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            return (events, true);
        }
        events.push(serde_json::from_str(data).expect("SSE JSON"));
    }
    (events, false)
}

/// A child process's stderr, collected line by line by a thread of its own
/// (so the child never blocks on a full pipe), for tests that check logs.
#[derive(Clone, Default)]
pub struct Log(std::sync::Arc<std::sync::Mutex<String>>);

impl Log {
    /// Starts collecting `stderr`.
    pub fn collect(stderr: impl std::io::Read + Send + 'static) -> Self {
        use std::io::BufRead;
        let log = Self::default();
        let text = log.0.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                let mut text = text.lock().unwrap_or_else(|p| p.into_inner());
                text.push_str(&line);
                text.push('\n');
            }
        });
        log
    }

    pub fn text(&self) -> String {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Waits up to `timeout` for a line containing `needle`; returns it.
    pub fn wait_for(&self, needle: &str, timeout: std::time::Duration) -> Option<String> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(line) = self.text().lines().find(|l| l.contains(needle)) {
                return Some(line.to_string());
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Coordinator {
    /// `start`, with the coordinator's stderr collected into a `Log`.
    pub fn start_logged(model: &str, local_workers: usize, extra: &[&str]) -> (Self, Log) {
        Self::start_logged_at(("127.0.0.1:0", "127.0.0.1:0"), model, local_workers, extra)
    }

    /// `start_logged`, listening on `(http, quic)`, each HOST:PORT.
    pub fn start_logged_at(
        (http, quic): (&str, &str),
        model: &str,
        local_workers: usize,
        extra: &[&str],
    ) -> (Self, Log) {
        let dir = TempDir::new("cluster");
        let secret_file = dir.0.join("secret");
        let mut child = Command::new(binary("tinyvllm-coordinator"))
            .args(["--model", model_dir(model).to_str().expect("utf-8 path"), "--http", http])
            .args(["--quic", quic, "--local-workers", &local_workers.to_string()])
            .arg("--cluster-secret-file")
            .arg(&secret_file)
            .args(extra)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting the coordinator");
        let log = Log::collect(child.stderr.take().expect("piped stderr"));
        (Self::attach(child, secret_file, dir, local_workers), log)
    }

    /// Starts `command` (the coordinator binary with the caller's model,
    /// arguments and environment) on loopback ports with a cluster secret
    /// and no local workers, its stderr collected.
    pub fn start_command(mut command: Command) -> (Self, Log) {
        let dir = TempDir::new("cluster");
        let secret_file = dir.0.join("secret");
        let mut child = command
            .args(["--http", "127.0.0.1:0", "--quic", "127.0.0.1:0", "--local-workers", "0"])
            .arg("--cluster-secret-file")
            .arg(&secret_file)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting the coordinator");
        let log = Log::collect(child.stderr.take().expect("piped stderr"));
        (Self::attach(child, secret_file, dir, 0), log)
    }

    /// The pid of local worker `name` (a child started with `--name NAME`).
    pub fn local_worker_pid(&self, name: &str) -> Option<u32> {
        child_pids(self.child.id()).into_iter().find(|&pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            args.windows(2).any(|w| w[0] == b"--name" && w[1] == name.as_bytes())
        })
    }
}

/// The children of process `pid` (Linux: from /proc).
pub fn child_pids(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| c.split_whitespace().filter_map(|p| p.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// A process's resident memory in KiB (Linux: from /proc), 0 if unknown.
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Sends `signal` (e.g. "-KILL", "-TERM") to process `pid`.
pub fn signal(pid: u32, signal: &str) {
    let _ = Command::new("kill").args([signal, &pid.to_string()]).status();
}

/// Streams a `/v1/completions` request (`body` gets `"stream": true`) and
/// returns its whole text; signals `started` once it has some text.
pub fn stream_completion_text(url: &str, mut body: serde_json::Value, started: std::sync::mpsc::Sender<()>) -> String {
    use std::io::BufRead;
    body["stream"] = serde_json::json!(true);
    let resp = ureq::post(url).send_json(body).expect("stream");
    let (mut text, mut told) = (String::new(), false);
    for line in std::io::BufReader::new(resp.into_reader()).lines() {
        let line = line.expect("line");
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let event: serde_json::Value = serde_json::from_str(data).expect("json");
        text += event["choices"][0]["text"].as_str().unwrap_or("");
        if !told && text.len() > 10 {
            let _ = started.send(());
            told = true;
        }
    }
    text
}

/// A greedy request of `max_tokens` that ignores EOS (so its length is known).
pub fn greedy(prompt: &str, max_tokens: u64) -> serde_json::Value {
    serde_json::json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

/// Each prompt's greedy `/v1/completions` text (`max_tokens` tokens), the
/// requests sent at once: the runs faults are compared with.
pub fn greedy_texts(cluster: &Coordinator, prompts: &[String], max_tokens: u64) -> Vec<String> {
    let requests: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (url, body) = (cluster.url("/v1/completions"), greedy(p, max_tokens));
            std::thread::spawn(move || {
                let (status, out) = post_json(&url, &body);
                assert_eq!(status, 200, "{out}");
                out["choices"][0]["text"].as_str().expect("a text").to_string()
            })
        })
        .collect();
    requests.into_iter().map(|h| h.join().expect("a request")).collect()
}

/// Streams each prompt's greedy completion (`max_tokens` tokens); once
/// every stream has text, runs `fault`; returns each stream's whole text.
pub fn streams_across(cluster: &Coordinator, prompts: &[String], max_tokens: u64, fault: impl FnOnce()) -> Vec<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (url, tx, body) = (cluster.url("/v1/completions"), tx.clone(), greedy(p, max_tokens));
            std::thread::spawn(move || stream_completion_text(&url, body, tx))
        })
        .collect();
    for _ in 0..prompts.len() {
        rx.recv_timeout(std::time::Duration::from_secs(120)).expect("every stream started");
    }
    fault();
    handles.into_iter().map(|h| h.join().expect("a stream")).collect()
}

/// The python that `.ci/run` gives the client tests (`TINYVLLM_TEST_PYTHON`),
/// or `None` outside CI when unset (the test then skips, saying it needs
/// the packages `needs` names). In CI it must be set.
pub fn test_python(needs: &str) -> Option<std::ffi::OsString> {
    let python = std::env::var_os("TINYVLLM_TEST_PYTHON");
    if python.is_none() {
        assert!(std::env::var_os("CI").is_none(), "TINYVLLM_TEST_PYTHON is not set in CI (.ci/run sets it)");
        eprintln!("skipping: set TINYVLLM_TEST_PYTHON to a python with {needs} installed (see .ci/run)");
    }
    python
}

/// Runs `tests/python/<script> <api_url> <model>` and checks that it
/// succeeded and printed `ok_line`.
pub fn run_python_client(python: &std::ffi::OsStr, script: &str, api_url: &str, model: &str, ok_line: &str) {
    let out = Command::new(python)
        .arg(repo_root().join("tests/python").join(script))
        .args([api_url, model])
        .output()
        .expect("running python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains(ok_line), "{stdout}");
}
