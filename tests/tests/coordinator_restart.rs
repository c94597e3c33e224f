//! A coordinator restart loses nothing that is not in flight (issue 58,
//! point 4). A 2-stage pipeline of real workers serves a coordinator that
//! is stopped (SIGTERM) mid-stream and started again on the same ports:
//! the cut stream ends with an error event and `[DONE]`, never silently;
//! the pipeline's first stage registers again by itself (its link to the
//! later stage never dropped) with its KV cache, so a prompt served before
//! the restart is a prefix hit after it; `/health` says when it is back;
//! and a request retried with its `Idempotency-Key` gets the answer the
//! first try had, from before the restart, without a second generation.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tinyvllm_tests::{Log, TempDir, binary, model_dir, terminate};

const MODEL: &str = "stories260K";

struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        terminate(&mut self.0);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("a free port").port()
}

/// The coordinator on fixed ports, its answers kept in `answers`.
fn start_coordinator(http: u16, quic: u16, dir: &TempDir) -> (Process, Log) {
    let mut child = Command::new(binary("tinyvllm-coordinator"))
        .args(["--model", model_dir(MODEL).to_str().unwrap(), "--local-workers", "0", "--no-discovery"])
        // A restart that does not wait long for streams: they are cut, and say so.
        .args(["--shutdown-timeout-secs", "0"])
        .args(["--http", &format!("127.0.0.1:{http}"), "--quic", &format!("127.0.0.1:{quic}")])
        .arg("--cluster-secret-file")
        .arg(dir.0.join("secret"))
        .arg("--idempotency-file")
        .arg(dir.0.join("answers.jsonl"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the coordinator");
    let log = Log::collect(child.stderr.take().expect("stderr"));
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("its first line");
    assert!(line.contains(&format!("http=127.0.0.1:{http}")), "{line}\n{}", log.text());
    (Process(child), log)
}

fn post(url: &str, body: &Value, key: Option<&str>) -> (u16, Value, bool) {
    let mut request = ureq::post(url);
    if let Some(key) = key {
        request = request.set("Idempotency-Key", key);
    }
    let (status, response) = match request.send_json(body.clone()) {
        Ok(r) => (r.status(), r),
        Err(ureq::Error::Status(code, r)) => (code, r),
        Err(e) => panic!("POST {url}: {e}"),
    };
    let replayed = response.header("idempotent-replayed") == Some("true");
    (status, response.into_json().unwrap_or(Value::Null), replayed)
}

fn health(http: u16) -> Option<(u16, Value)> {
    match ureq::get(&format!("http://127.0.0.1:{http}/health")).timeout(Duration::from_secs(2)).call() {
        Ok(r) => Some((r.status(), r.into_json().ok()?)),
        Err(ureq::Error::Status(code, r)) => Some((code, r.into_json().ok()?)),
        Err(_) => None,
    }
}

fn wait_healthy(http: u16, log: &Log, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if health(http).is_some_and(|(status, _)| status == 200) {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "not healthy within {within:?}:\n{}", log.text());
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The two stages: the later one listening, the first joining the coordinator.
fn start_pipeline(quic: u16, dir: &TempDir) -> (Process, Process, Log) {
    let later_port = free_udp_port();
    let later = Command::new(binary("tinyvllm-worker"))
        .args(["serve", "--model", model_dir(MODEL).to_str().unwrap(), "--layers", "3-4", "--name", "stage-1"])
        .args(["--stage-listen", &format!("127.0.0.1:{later_port}"), "--kv-cache-memory", "4000000"])
        .arg("--cluster-secret-file")
        .arg(dir.0.join("secret"))
        .stderr(Stdio::null())
        .spawn()
        .expect("the later stage");
    let mut first = Command::new(binary("tinyvllm-worker"))
        .args(["serve", "--model", model_dir(MODEL).to_str().unwrap(), "--layers", "0-2", "--name", "stage-0"])
        .args(["--next-stage", &format!("127.0.0.1:{later_port}"), "--coordinator", &format!("127.0.0.1:{quic}")])
        .args(["--kv-cache-memory", "4000000"])
        .arg("--cluster-secret-file")
        .arg(dir.0.join("secret"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("the first stage");
    let log = Log::collect(first.stderr.take().expect("stderr"));
    (Process(later), Process(first), log)
}

#[test]
fn a_restarted_coordinator_keeps_caches_and_answers_and_cut_streams_say_so() {
    let dir = TempDir::new("restart");
    let (http, quic) = (free_port(), free_udp_port());
    let (coordinator, log) = start_coordinator(http, quic, &dir);
    let (later, _first, stage_log) = start_pipeline(quic, &dir);
    wait_healthy(http, &stage_log, Duration::from_secs(120));
    let completions = format!("http://127.0.0.1:{http}/v1/completions");

    // A keyed request, its retry, and the key reused for another body.
    let body = json!({"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0.8, "seed": 7});
    let (status, first, replayed) = post(&completions, &body, Some("order-1"));
    assert_eq!((status, replayed), (200, false), "{first}");
    let (status, again, replayed) = post(&completions, &body, Some("order-1"));
    assert_eq!((status, replayed), (200, true), "{again}");
    assert_eq!(again, first, "the same answer, id included");
    let other = json!({"prompt": "The little dog", "max_tokens": 8});
    let (status, error, _) = post(&completions, &other, Some("order-1"));
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["param"], "Idempotency-Key", "{error}");
    let (status, error, _) = post(&completions, &other, Some("bad key with spaces"));
    assert_eq!(status, 400, "{error}");

    // A long prompt, to be found in the cache after the restart.
    let long = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.";
    let greedy = json!({"prompt": long, "max_tokens": 8, "temperature": 0});
    let (status, before, _) = post(&completions, &greedy, None);
    assert_eq!(status, 200, "{before}");

    // SIGTERM mid-stream: the stream ends with an error event, then [DONE].
    // The later stage is frozen once the first token is out, so the stream
    // is surely still running when the signal lands (a fast machine finishes
    // 400 tokens of this model in well under 100 ms).
    let stream_url = completions.clone();
    let (first_token, started) = std::sync::mpsc::channel();
    let streaming = std::thread::spawn(move || {
        let body = json!({"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": true,
                          "stream": true});
        let resp = ureq::post(&stream_url).send_json(body).expect("a stream");
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(resp.into_reader()).lines().map_while(Result::ok) {
            if line.starts_with("data: ") {
                let _ = first_token.send(());
            }
            lines.push(line);
        }
        lines
    });
    started.recv_timeout(Duration::from_secs(30)).expect("the stream's first token");
    tinyvllm_tests::signal(later.0.id(), "-STOP");
    let stopped = Instant::now();
    tinyvllm_tests::signal(coordinator.0.id(), "-TERM");
    let lines = streaming.join().expect("the stream");
    tinyvllm_tests::signal(later.0.id(), "-CONT");
    let data: Vec<&str> = lines.iter().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{lines:?}");
    let error: Value = serde_json::from_str(data[data.len() - 2]).expect("an event");
    assert!(error["error"]["message"].as_str().is_some_and(|m| m.contains("shutting down")), "{error}");
    drop(coordinator);
    let down_for = stopped.elapsed();

    // The same ports again: the first stage finds it, its cache warm.
    let (coordinator, log2) = start_coordinator(http, quic, &dir);
    let back_after = wait_healthy(http, &log2, Duration::from_secs(60));
    let (status, after, _) = post(&completions, &greedy, None);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    let cached = after["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    assert!(cached >= 16, "the prefix cache survived the restart: {after}");
    let workers: Value = ureq::get(&format!("http://127.0.0.1:{http}/v1/workers")).call().unwrap().into_json().unwrap();
    assert_eq!(workers["data"][0]["stages"].as_array().map(Vec::len), Some(2), "{workers}");

    // The keyed request's answer, kept through the restart, with no new generation.
    let (status, replay, replayed) = post(&completions, &body, Some("order-1"));
    assert_eq!((status, replayed), (200, true), "{replay}\n{}", log2.text());
    assert_eq!(replay, first);
    eprintln!("down for {down_for:?}; healthy again {back_after:?} after the new start; {cached} tokens cached");
    drop(coordinator);
    let _ = log;
}
