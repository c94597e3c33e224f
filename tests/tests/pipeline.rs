//! Pipeline parallelism end to end (issue 30): a model's layers split over
//! 2 or 3 real worker processes linked over QUIC on loopback, behind a real
//! coordinator. Greedy output must equal transformers' golden tokens
//! exactly, with chunked prefill, prefix-cache hits, preemption and n-gram
//! speculation (the last stage verifies); seeded sampling equals one
//! worker's; a stage lost mid-stream loses no token; a stage of another
//! model is refused.

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use tinyvllm_tests::{
    Coordinator, Log, TempDir, binary, golden, greedy, greedy_texts, model_dir, plan_device, post_json, signal,
    streams_across, terminate,
};

/// Every golden case of `model` through `/generate` and `/v1/completions`;
/// the second request of each prompt hits the prefix cache when the prompt
/// has a full block. Returns the cached tokens seen.
fn check_goldens(cluster: &Coordinator, model: &str) -> u64 {
    let mut cached = 0;
    for case in golden(&format!("{model}.json"))["cases"].as_array().expect("cases") {
        let prompt = case["prompt_text"].as_str().unwrap();
        let (status, out) = post_json(&cluster.url("/generate"), &greedy(prompt, 48));
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "{model} case {}", case["id"]);
        let (status, completion) = post_json(&cluster.url("/v1/completions"), &greedy(prompt, 48));
        assert_eq!(status, 200, "{completion}");
        assert_eq!(completion["choices"][0]["text"], out["text"], "{model} case {}", case["id"]);
        cached += completion["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
    }
    cached
}

#[test]
fn two_stages_reproduce_every_models_goldens_with_chunked_prefill_and_cache_hits() {
    let models = [
        "stories260K",
        "tiny-llama3",
        "tiny-mistral",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-qwen3-yarn",
        "tiny-mixtral",
        "tiny-qwen3-moe",
        "tiny-glm4-moe",
        "tiny-gemma3",
        "tiny-gpt-oss",
    ];
    for model in models {
        // Blocks of 4 tokens, so short prompts have cached blocks; 8
        // tokens a step, so longer prompts are prefilled in chunks.
        let extra = ["--block-size", "4", "--worker-arg=--max-num-batched-tokens=8"];
        let cluster = Coordinator::start_pipelines(model, 1, 2, &extra);
        let cached = check_goldens(&cluster, model);
        assert!(cached > 0, "{model}: the repeated prompts hit the prefix cache");
        let workers = cluster.workers();
        let workers = workers["data"].as_array().unwrap();
        assert_eq!(workers.len(), 1, "a pipeline is one routing target: {workers:?}");
        let stages = workers[0]["stages"].as_array().expect("stages");
        let names: Vec<&str> = stages.iter().map(|s| s["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["local-0", "local-0-stage-1"], "{model}");
        assert!(stages.iter().all(|s| s["weight_bytes"].as_u64() > Some(0) && s["kv_bytes"].as_u64() > Some(0)));
    }
}

/// The new families from the GGUF files llama.cpp's converter made of
/// them (worker/tests/data/llamacpp), each with its tokenizer.json beside
/// it for the coordinator: two stages of real worker processes, chunked
/// prefill and prefix-cache hits, every golden case exact.
#[test]
fn two_stages_of_llama_cpp_s_gguf_files_reproduce_the_goldens() {
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/tests/data/llamacpp");
    for model in ["tiny-mixtral", "tiny-qwen3-moe", "tiny-glm4-moe", "tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-yarn"] {
        let dir = TempDir::new("gguf-stages");
        let file = dir.0.join(format!("{model}.gguf"));
        std::fs::copy(data.join(format!("{model}-f32.gguf")), &file).expect("copying the GGUF file");
        std::fs::copy(model_dir(model).join("tokenizer.json"), dir.0.join("tokenizer.json")).expect("tokenizer");
        let extra = ["--block-size", "4", "--worker-arg=--max-num-batched-tokens=8"];
        let cluster = Coordinator::start_pipelines(file.to_str().unwrap(), 1, 2, &extra);
        let cached = check_goldens(&cluster, model);
        assert!(cached > 0, "{model}: the repeated prompts hit the prefix cache");
        let stages = &cluster.workers()["data"][0]["stages"];
        assert_eq!(stages.as_array().map(Vec::len), Some(2), "{model}: {stages}");
    }
}

/// n-gram speculation on every running request (eager: 1-token matches).
const SPECULATE: [&str; 3] = [
    "--worker-arg=--speculative-method=ngram",
    "--worker-arg=--prompt-lookup-min=1",
    "--worker-arg=--speculative-max-batch-tokens=1000",
];

#[test]
fn two_speculating_stages_reproduce_every_models_goldens() {
    // Stage 0 proposes, the last stage verifies: the output is plain decoding's.
    for model in ["tiny-llama3", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"] {
        let mut extra = vec!["--block-size", "4"];
        extra.extend(SPECULATE);
        let cluster = Coordinator::start_pipelines(model, 1, 2, &extra);
        check_goldens(&cluster, model);
        let stats = &cluster.workers()["data"][0]["stats"];
        let metrics = worker_metrics_text(&cluster);
        let proposed = sample(&metrics, "vllm:spec_decode_num_draft_tokens_total", &[]);
        let accepted = sample(&metrics, "vllm:spec_decode_num_accepted_tokens_total", &[]);
        assert!(proposed > 0.0 && accepted < proposed, "{model}: {proposed} proposed, {accepted} accepted; {stats}");
    }
}

/// Both stages on the Metal step plan, in the CPU emulator: the first
/// stage's plan holds the embedding and hands hidden states on, the last
/// stage's holds the head. Tied embeddings (stories260K) and not
/// (tiny-llama3); mixtures of experts (GLM-4.5's dense first layer on one
/// stage, its experts on both) and gpt-oss's sinks and windows; chunked
/// prefill, prefix-cache hits and n-gram speculation verified on the last
/// stage.
#[test]
fn two_metal_emulated_stages_reproduce_the_goldens() {
    let device = format!("--worker-arg=--device={}", plan_device());
    for model in ["stories260K", "tiny-llama3", "tiny-glm4-moe", "tiny-gpt-oss"] {
        let mut extra = vec!["--block-size", "4", "--worker-arg=--max-num-batched-tokens=8", &device];
        extra.extend(SPECULATE);
        let cluster = Coordinator::start_pipelines(model, 1, 2, &extra);
        let cached = check_goldens(&cluster, model);
        assert!(cached > 0, "{model}: the repeated prompts hit the prefix cache");
        let workers = cluster.workers();
        assert!(workers.to_string().contains(plan_device()), "{workers}");
        let stages = workers["data"][0]["stages"].as_array().expect("stages");
        assert_eq!(stages.len(), 2, "{model}: {stages:?}");
        if model == "stories260K" {
            // The last stage draws on the GPU: seeded sampling with
            // penalties and logprobs gives a CPU worker's tokens (logprobs
            // to f32 rounding: the GPU's logits differ in the last bits).
            let body = json!({
                "prompt": "Once upon a time there was", "max_tokens": 24, "temperature": 0.8, "seed": 7,
                "logprobs": 2, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "min_tokens": 20
            });
            let (status, on_stages) = post_json(&cluster.url("/generate"), &body);
            assert_eq!(status, 200, "{on_stages}");
            let (status, on_cpu) = post_json(&Coordinator::start(model, 1, &[]).url("/generate"), &body);
            assert_eq!(status, 200, "{on_cpu}");
            assert_eq!(on_stages["token_ids"], on_cpu["token_ids"]);
            assert_close(&on_stages["logprobs"], &on_cpu["logprobs"]);
        }
    }
}

/// JSON equal but for numbers, which may differ by 1e-3.
fn assert_close(a: &Value, b: &Value) {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            assert!((x - y).abs() <= 1e-3 * y.abs().max(1.0), "{x} vs {y}");
        }
        (Value::Array(x), Value::Array(y)) => {
            assert_eq!(x.len(), y.len(), "{a} vs {b}");
            x.iter().zip(y).for_each(|(x, y)| assert_close(x, y));
        }
        (Value::Object(x), Value::Object(y)) => {
            assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>(), "{a} vs {b}");
            x.iter().for_each(|(k, v)| assert_close(v, &y[k]));
        }
        _ => assert_eq!(a, b),
    }
}

/// The first stage's Prometheus text.
fn worker_metrics_text(cluster: &Coordinator) -> String {
    let targets: Value =
        ureq::get(&cluster.url("/v1/prometheus/targets")).call().expect("targets").into_json().expect("json");
    let address = targets[0]["targets"][0].as_str().expect("the first stage's address").to_string();
    ureq::get(&format!("http://{address}/metrics")).call().expect("scrape").into_string().expect("text")
}

#[test]
fn three_stages_of_stories260k_reproduce_the_goldens() {
    let cluster = Coordinator::start_pipelines("stories260K", 1, 3, &[]);
    check_goldens(&cluster, "stories260K");
    let workers = cluster.workers();
    let layers: Vec<&str> =
        workers["data"][0]["stages"].as_array().unwrap().iter().map(|s| s["layers"].as_str().unwrap()).collect();
    assert_eq!(layers, ["0-1", "2-3", "4-4"], "5 layers split evenly over 3 stages");
}

#[test]
fn more_stages_than_layers_is_refused_at_start() {
    let dir = TempDir::new("pp-refused");
    let out = Command::new(binary("tinyvllm-coordinator"))
        .args(["--model", model_dir("tiny-llama3").to_str().unwrap(), "--http", "127.0.0.1:0", "--quic", "127.0.0.1:0"])
        .args(["--local-workers", "3", "--pipeline-parallel-size", "3"])
        .arg("--cluster-secret-file")
        .arg(dir.0.join("secret"))
        .output()
        .expect("running the coordinator");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot split 2 layers over 3 stages"), "{err}");
}

/// Starts a later stage by hand; returns it, its log and its address.
fn start_stage(
    model: &str,
    layers: &str,
    secret: &std::path::Path,
    dir: &TempDir,
) -> (std::process::Child, Log, String) {
    let file = dir.0.join(format!("{model}-{layers}.addr"));
    let mut child = Command::new(binary("tinyvllm-worker"))
        .args(["serve", "--model", model_dir(model).to_str().unwrap(), "--layers", layers, "--name", "later"])
        .args(["--stage-listen", "127.0.0.1:0", "--kv-cache-memory", "4000000"])
        .arg("--stage-address-file")
        .arg(&file)
        .arg("--cluster-secret-file")
        .arg(secret)
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting a stage");
    let log = Log::collect(child.stderr.take().unwrap());
    for _ in 0..600 {
        if let Ok(address) = std::fs::read_to_string(&file) {
            return (child, log, address);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    terminate(&mut child);
    panic!("the stage never listened: {}", log.text());
}

#[test]
fn a_stage_of_another_model_is_refused_naming_both() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let dir = TempDir::new("pp-mismatch");
    let (mut later, later_log, address) = start_stage("tiny-llama3", "1-1", &cluster.secret_file, &dir);
    let out = Command::new(binary("tinyvllm-worker"))
        .args(["serve", "--model", model_dir("stories260K").to_str().unwrap(), "--layers", "0-0"])
        .args(["--next-stage", &address, "--coordinator", &cluster.quic, "--name", "first"])
        .arg("--cluster-secret-file")
        .arg(&cluster.secret_file)
        .output()
        .expect("running the first stage");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("model files differ") && err.contains("stories260K") && err.contains("tiny-llama3"), "{err}");
    assert!(later_log.wait_for("refused a stage before", Duration::from_secs(10)).is_some(), "{}", later_log.text());
    terminate(&mut later);
}

/// Starts a first stage (layers 0-1 of stories260K) by hand, joining
/// `cluster` with `address` as its next stage; returns it and its log.
fn start_first_stage(cluster: &Coordinator, address: &str, name: &str) -> (std::process::Child, Log) {
    let mut first = Command::new(binary("tinyvllm-worker"))
        .args(["serve", "--model", model_dir("stories260K").to_str().unwrap(), "--layers", "0-1"])
        .args(["--next-stage", address, "--coordinator", &cluster.quic, "--name", name])
        .arg("--cluster-secret-file")
        .arg(&cluster.secret_file)
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting the first stage");
    let log = Log::collect(first.stderr.take().unwrap());
    (first, log)
}

fn prompts_and_reference(cluster: &Coordinator) -> (Vec<String>, Vec<String>) {
    let prompts: Vec<String> =
        (0..6).map(|i| format!("Once upon a time, there was a {}", ["dog", "cat", "girl"][i % 3])).collect();
    let reference = greedy_texts(cluster, &prompts, 200);
    (prompts, reference)
}

#[test]
fn a_stage_killed_mid_stream_moves_its_pipelines_streams_to_a_replica_losing_no_token() {
    // A replica and a 2-stage pipeline, started by hand, in one cluster.
    // Round robin gives the pipeline half the streams whatever the caches
    // hold, so some are on it when its second stage dies.
    let cluster = Coordinator::start("stories260K", 0, &["--policy", "round_robin"]);
    let mut replica = cluster.start_worker("stories260K", "replica", &cluster.secret_file);
    let dir = TempDir::new("pp-kill");
    let (mut later, _later_log, address) = start_stage("stories260K", "2-4", &cluster.secret_file, &dir);
    let (mut first, first_log) = start_first_stage(&cluster, &address, "pipeline");
    cluster.wait_for_workers(2);
    let (prompts, reference) = prompts_and_reference(&cluster);
    let texts = streams_across(&cluster, &prompts, 200, || {
        later.kill().unwrap(); // SIGKILL
        later.wait().unwrap();
    });
    assert_eq!(texts, reference, "every stream, whole, after the kill");
    assert!(!first.wait().unwrap().success(), "the first stage leaves the cluster");
    assert!(first_log.text().contains("pipeline lost"), "{}", first_log.text());
    let metrics = ureq::get(&cluster.url("/metrics")).call().unwrap().into_string().unwrap();
    let redispatched = metrics
        .lines()
        .find_map(|l| l.strip_prefix("tinyvllm_redispatches_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(redispatched.is_some_and(|n| n > 0.0), "the pipeline's streams moved: {redispatched:?}");
    terminate(&mut replica);
}

/// A first stage with no request to step still notices that its next
/// stage died, and leaves the cluster instead of taking requests it cannot
/// serve.
#[test]
fn an_idle_first_stage_leaves_when_its_next_stage_dies() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let dir = TempDir::new("pp-idle");
    let (mut later, _later_log, address) = start_stage("stories260K", "2-4", &cluster.secret_file, &dir);
    let (mut first, first_log) = start_first_stage(&cluster, &address, "idle-pipeline");
    cluster.wait_for_workers(1);
    later.kill().unwrap(); // SIGKILL, with nothing in flight
    later.wait().unwrap();
    let exited = (0..300).find_map(|_| {
        std::thread::sleep(Duration::from_millis(100));
        first.try_wait().unwrap()
    });
    let Some(status) = exited else {
        terminate(&mut first);
        panic!("the idle first stage stayed: {}", first_log.text());
    };
    assert!(!status.success(), "it leaves with an error");
    assert!(first_log.text().contains("pipeline lost while idle"), "{}", first_log.text());
    // The coordinator routes nothing more to it.
    let gone = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        cluster.workers()["data"].as_array().is_some_and(|w| w.is_empty())
    });
    assert!(gone, "{}", cluster.workers());
}

#[test]
fn a_local_pipeline_that_loses_a_stage_is_formed_again() {
    let cluster = Coordinator::start_pipelines("stories260K", 2, 2, &[]);
    let (prompts, reference) = prompts_and_reference(&cluster);
    let texts = streams_across(&cluster, &prompts, 200, || {
        signal(cluster.local_worker_pid("local-0-stage-1").expect("pipeline 0's second stage"), "-KILL");
    });
    assert_eq!(texts, reference, "every stream, whole, after the kill");
    cluster.wait_for_workers(2);
    let (status, _) = post_json(&cluster.url("/v1/completions"), &greedy("The dog", 8));
    assert_eq!(status, 200);
}

#[test]
fn seeded_sampling_penalties_and_logprobs_match_a_single_worker() {
    // The last stage samples from what the header carries: the seed, the
    // output count, the token history for penalties; prompt logprobs come
    // back as logits. All of it must match one worker's answer exactly.
    let body = json!({
        "prompt": "Once upon a time there was", "max_tokens": 24, "temperature": 0.8, "seed": 7,
        "logprobs": 2, "prompt_logprobs": 1, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "min_tokens": 20
    });
    let answer = |cluster: &Coordinator| {
        let (status, mut out) = post_json(&cluster.url("/generate"), &body);
        assert_eq!(status, 200, "{out}");
        out.as_object_mut().unwrap().remove("worker");
        out
    };
    let pipeline = answer(&Coordinator::start_pipelines("stories260K", 1, 2, &[]));
    let single = answer(&Coordinator::start("stories260K", 1, &[]));
    assert!(pipeline["prompt_logprobs"].as_array().is_some_and(|p| p.len() > 1), "{pipeline}");
    assert!(pipeline["logprobs"].as_array().is_some_and(|p| p.len() == 24), "{pipeline}");
    assert_eq!(pipeline, single);
}

#[test]
fn two_stages_stay_exact_under_preemption() {
    two_stages_under_preemption(&[]);
}

#[test]
fn two_speculating_stages_stay_exact_under_preemption() {
    two_stages_under_preemption(&SPECULATE);
}

fn two_stages_under_preemption(extra: &[&str]) {
    // About 9 blocks of 16 tokens for the whole pipeline: 4 requests of 56
    // tokens at once do not fit, so some are preempted and recomputed.
    let mut args = vec!["--worker-arg=--kv-cache-memory=120000"];
    args.extend_from_slice(extra);
    let cluster = Coordinator::start_pipelines("stories260K", 1, 2, &args);
    let cases: Vec<Value> = golden("stories260K.json")["cases"].as_array().unwrap().iter().take(4).cloned().collect();
    let handles: Vec<_> = cases
        .iter()
        .map(|case| {
            let url = cluster.url("/generate");
            let body = greedy(case["prompt_text"].as_str().unwrap(), 48);
            std::thread::spawn(move || post_json(&url, &body))
        })
        .collect();
    for (case, h) in cases.iter().zip(handles) {
        let (status, out) = h.join().unwrap();
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "case {}", case["id"]);
    }
    // The first stage's stats reach the coordinator once a second.
    let preempted = (0..100).any(|_| {
        let workers = cluster.workers();
        let n = workers["data"][0]["stats"]["num_preemptions"].as_u64();
        n > Some(0) || {
            std::thread::sleep(Duration::from_millis(100));
            false
        }
    });
    assert!(preempted, "no preemption happened: {}", cluster.workers());
    if !extra.is_empty() {
        let metrics = worker_metrics_text(&cluster);
        let accepted = sample(&metrics, "vllm:spec_decode_num_accepted_tokens_total", &[]);
        assert!(accepted > 0.0, "no proposal was accepted");
    }
}

/// A metric's value in Prometheus text: the first sample of `name` with
/// every label of `labels` (in any order: registry labels come unordered).
fn sample(text: &str, name: &str, labels: &[&str]) -> f64 {
    let line = text
        .lines()
        .find(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|label| l.contains(label)))
        .unwrap_or_else(|| panic!("no {name} {labels:?} in\n{text}"));
    line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

#[test]
fn each_stage_serves_its_step_bytes_wait_and_bubble_metrics() {
    let cluster = Coordinator::start_pipelines("stories260K", 1, 2, &[]);
    // Concurrent streams, so the first stage has two micro-batches in flight.
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let url = cluster.url("/generate");
            std::thread::spawn(move || post_json(&url, &greedy(&format!("Once upon a time {i}"), 24)))
        })
        .collect();
    for h in handles {
        let (status, out) = h.join().expect("request thread");
        assert_eq!(status, 200, "{out}");
    }
    // Both stages are scrape targets: the later one through the first's registration.
    let targets: Value =
        ureq::get(&cluster.url("/v1/prometheus/targets")).call().expect("targets").into_json().expect("json");
    let targets = targets.as_array().expect("target groups");
    let names: Vec<&str> = targets.iter().map(|t| t["labels"]["worker"].as_str().unwrap()).collect();
    assert_eq!(names, ["local-0", "local-0-stage-1"], "{targets:?}");
    let scrape = |t: &Value| {
        let address = t["targets"][0].as_str().expect("address");
        ureq::get(&format!("http://{address}/metrics")).call().expect("scrape").into_string().expect("text")
    };
    let (first, later) = (scrape(&targets[0]), scrape(&targets[1]));
    for (text, layers, worker) in [(&first, "0-2", "local-0"), (&later, "3-4", "local-0-stage-1")] {
        let (layers, worker) = (format!("layers=\"{layers}\""), format!("worker=\"{worker}\""));
        let labels = [layers.as_str(), worker.as_str(), "model_name=\"stories260K\""];
        assert!(sample(text, "tinyvllm:pipeline_step_seconds_count", &labels) > 0.0, "{text}");
        assert!(sample(text, "tinyvllm:pipeline_step_sent_bytes_sum", &labels) > 0.0, "{text}");
        assert!(sample(text, "tinyvllm:pipeline_step_received_bytes_sum", &labels) > 0.0, "{text}");
        assert!(sample(text, "tinyvllm:pipeline_active_seconds_total", &labels) > 0.0, "{text}");
        let bubble = sample(text, "tinyvllm:pipeline_bubble_fraction", &labels);
        assert!((0.0..1.0).contains(&bubble), "{bubble}");
        assert!(text.contains("# TYPE tinyvllm:pipeline_wait_seconds histogram"), "{text}");
        assert!(sample(text, "process_resident_memory_bytes", &[]) > 0.0, "{text}");
    }
    // The first stage waits for results (and times the wire); the later one for the previous stage.
    assert!(sample(&first, "tinyvllm:pipeline_transfer_seconds_count", &[]) > 0.0, "{first}");
    assert!(first.contains("for=\"results\"") && later.contains("for=\"previous_stage\""));
    assert!(
        first.contains("\nvllm:num_requests_running") && !later.contains("\nvllm:"),
        "only the first stage schedules"
    );
}
