//! Pipelines formed by the coordinator from remote workers (issue 30):
//! real worker processes started with `--layers auto` and a
//! `--memory-limit` offer themselves to a real coordinator over QUIC,
//! which splits the model's layers in proportion to the memory offered.
//! Until the offers hold the model together, `/health` and a request's
//! 503 say what is missing; once they do, the pipeline serves the golden
//! tokens exactly, as it does when `--pipeline-parallel-size` asks for
//! stages of workers that each hold the model.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, Log, binary, golden, model_dir, post_json, terminate};

const MODEL: &str = "stories260K";

/// Bytes of the model's safetensors files: its f32 weights and a header.
fn weight_bytes() -> u64 {
    std::fs::read_dir(model_dir(MODEL))
        .expect("the model's directory")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| std::fs::metadata(p).expect("a weights file").len())
        .sum()
}

/// A worker that offers `memory` bytes and waits to be assigned layers.
struct AutoWorker {
    child: Child,
    log: Log,
}

impl AutoWorker {
    fn start(cluster: &Coordinator, name: &str, memory: u64) -> Self {
        let mut child = Command::new(binary("tinyvllm-worker"))
            .args(["serve", "--model", model_dir(MODEL).to_str().unwrap(), "--layers", "auto"])
            .args(["--coordinator", &cluster.quic, "--name", name, "--memory-limit", &memory.to_string()])
            .args(["--kv-cache-memory", "4000000", "--stage-listen", "127.0.0.1:0"])
            .arg("--cluster-secret-file")
            .arg(&cluster.secret_file)
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting a worker");
        let log = Log::collect(child.stderr.take().unwrap());
        Self { child, log }
    }
}

impl Drop for AutoWorker {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// `GET /health`'s status code and body (503 included).
fn health(cluster: &Coordinator) -> (u16, Value) {
    match ureq::get(&cluster.url("/health")).call() {
        Ok(resp) => (resp.status(), resp.into_json().expect("json")),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_json().expect("json")),
        Err(e) => panic!("GET /health: {e}"),
    }
}

/// Waits until `n` offers wait to be formed; returns `/health` then.
fn wait_for_offers(cluster: &Coordinator, n: usize, workers: &[&AutoWorker]) -> (u16, Value) {
    for _ in 0..600 {
        let (status, body) = health(cluster);
        if body["pipeline_formation"]["offers"].as_array().map(Vec::len) == Some(n) {
            return (status, body);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let logs: Vec<String> = workers.iter().map(|w| w.log.text()).collect();
    panic!("{n} offers never waited: {:?}\n{}", health(cluster), logs.join("\n"));
}

/// Each stage's worker name and layers, as `/v1/workers` shows them.
fn stages(cluster: &Coordinator) -> Vec<(String, String)> {
    let workers = cluster.workers();
    let data = workers["data"].as_array().expect("data");
    assert_eq!(data.len(), 1, "a pipeline is one routing target: {workers}");
    data[0]["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["layers"].as_str().unwrap().to_string()))
        .collect()
}

/// Every golden case through `/generate` (the tokens) and
/// `/v1/completions` (the same text).
fn serves_the_goldens(cluster: &Coordinator) {
    for case in golden(&format!("{MODEL}.json"))["cases"].as_array().expect("cases") {
        let body = json!({"prompt": case["prompt_text"], "max_tokens": 48, "temperature": 0, "ignore_eos": true});
        let (status, out) = post_json(&cluster.url("/generate"), &body);
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "case {}", case["id"]);
        let (status, completion) = post_json(&cluster.url("/v1/completions"), &body);
        assert_eq!(status, 200, "{completion}");
        assert_eq!(completion["choices"][0]["text"], out["text"], "case {}", case["id"]);
    }
}

#[test]
fn workers_too_small_alone_wait_then_form_a_pipeline_split_by_memory() {
    let cluster = Coordinator::start(MODEL, 0, &[]);
    let weights = weight_bytes();
    // 3/4 of a worker's memory may hold weights: `big` alone cannot hold
    // the model; with `small` they can, split 1 : 0.6 over 5 layers (3 + 2).
    let big = AutoWorker::start(&cluster, "big", weights);
    let (status, body) = wait_for_offers(&cluster, 1, &[&big]);
    assert_eq!((status, body["status"].as_str()), (503, Some("no ready worker")), "{body}");
    let problem = body["pipeline_formation"]["problem"].as_str().expect("a problem");
    assert!(problem.contains("the model needs") && problem.contains("1 worker offers"), "{problem}");
    assert_eq!(body["pipeline_formation"]["offers"][0]["name"], "big");
    let request = json!({"prompt": "Once upon a time", "max_tokens": 4});
    let (status, error) = post_json(&cluster.url("/v1/completions"), &request);
    assert_eq!(status, 503, "{error}");
    let message = error["error"]["message"].as_str().expect("an OpenAI-style error");
    assert!(message.contains("no worker is available") && message.contains("the model needs"), "{message}");
    assert!(big.log.wait_for("waiting for a pipeline to be formed", Duration::from_secs(10)).is_some());

    let small = AutoWorker::start(&cluster, "small", weights * 6 / 10);
    cluster.wait_for_workers(1);
    let expected = [("big".to_string(), "0-2".to_string()), ("small".to_string(), "3-4".to_string())];
    assert_eq!(stages(&cluster), expected);
    let (status, body) = health(&cluster);
    assert_eq!(status, 200, "{body}");
    assert!(body.get("pipeline_formation").is_none(), "nothing waits any more: {body}");
    serves_the_goldens(&cluster);
    assert!(small.log.text().contains("assigned layers 3-4 of 5: stage 1 of 2"), "{}", small.log.text());
}

#[test]
fn three_workers_form_a_pipeline_when_two_are_not_enough() {
    let cluster = Coordinator::start(MODEL, 0, &[]);
    let weights = weight_bytes();
    let mut workers = Vec::new();
    // 0.65 and 0.6 hold 0.94 of the weights; with 0.5 they hold 1.31.
    for (k, (name, share)) in [("a", 65), ("b", 60), ("c", 50)].into_iter().enumerate() {
        workers.push(AutoWorker::start(&cluster, name, weights * share / 100));
        if k < 2 {
            wait_for_offers(&cluster, k + 1, &workers.iter().collect::<Vec<_>>());
        }
    }
    cluster.wait_for_workers(1);
    let layers: Vec<String> = stages(&cluster).into_iter().map(|(_, l)| l).collect();
    assert_eq!(layers, ["0-1", "2-3", "4-4"], "5 layers split 65 : 60 : 50");
    serves_the_goldens(&cluster);
}

#[test]
fn a_worker_that_holds_the_model_alone_is_a_replica() {
    let cluster = Coordinator::start(MODEL, 0, &[]);
    let _whole = AutoWorker::start(&cluster, "whole", weight_bytes() * 2);
    cluster.wait_for_workers(1);
    assert_eq!(stages(&cluster), [("whole".to_string(), "0-4".to_string())]);
    let (status, out) = post_json(&cluster.url("/generate"), &json!({"prompt": "Once upon a time", "max_tokens": 4}));
    assert_eq!(status, 200, "{out}");
}

#[test]
fn pipeline_parallel_size_splits_even_workers_that_each_hold_the_model() {
    let cluster = Coordinator::start(MODEL, 0, &["--pipeline-parallel-size", "2"]);
    let first = AutoWorker::start(&cluster, "first", weight_bytes() * 10);
    let (_, body) = wait_for_offers(&cluster, 1, &[&first]);
    let problem = body["pipeline_formation"]["problem"].as_str().expect("a problem");
    assert!(problem.contains("--pipeline-parallel-size 2 needs 2 workers; 1 has offered"), "{problem}");
    let _second = AutoWorker::start(&cluster, "second", weight_bytes() * 10);
    cluster.wait_for_workers(1);
    let expected = [("first".to_string(), "0-2".to_string()), ("second".to_string(), "3-4".to_string())];
    assert_eq!(stages(&cluster), expected, "equal memory: 5 layers as 3 + 2");
    serves_the_goldens(&cluster);
}

#[test]
fn a_formed_pipeline_that_loses_a_stage_is_formed_again_from_new_offers() {
    let cluster = Coordinator::start(MODEL, 0, &[]);
    let weights = weight_bytes();
    let mut big = AutoWorker::start(&cluster, "big", weights);
    wait_for_offers(&cluster, 1, &[&big]);
    let small = AutoWorker::start(&cluster, "small", weights * 6 / 10);
    cluster.wait_for_workers(1);
    // The first stage dies: the last stage leaves its broken pipeline and
    // offers itself again; with a new worker's offer they form a new one,
    // the earlier offer first.
    big.child.kill().unwrap(); // SIGKILL
    big.child.wait().unwrap();
    wait_for_offers(&cluster, 1, &[&small]);
    assert!(small.log.text().contains("offering this worker again"), "{}", small.log.text());
    let _replacement = AutoWorker::start(&cluster, "replacement", weights);
    cluster.wait_for_workers(1);
    let expected = [("small".to_string(), "0-1".to_string()), ("replacement".to_string(), "2-4".to_string())];
    assert_eq!(stages(&cluster), expected);
    serves_the_goldens(&cluster);
}
