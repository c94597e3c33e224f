//! Workers fetch only what they run (issue 57, point 5): a coordinator and
//! two workers started with a hub id (`org/stories260K`), each machine with
//! its own Hugging Face cache and its own hub (`HF_ENDPOINT`, a loopback
//! server speaking the hub's file protocol to the real `hf-hub` client; see
//! `tinyvllm_tests::hub`), the weights sharded a layer a shard as big
//! checkpoints are. The coordinator fetches no weights; each stage of the
//! formed pipeline fetches the config, the tokenizer files, the index and
//! only the shards holding its tensors; while it downloads, `/v1/workers`
//! lists it under `preparing` with its progress, and its log has progress
//! lines. The pipeline then serves the golden tokens exactly. A worker
//! with the wrong secret is refused before it fetches any weights.

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use tinyvllm_tests::hub::{FakeHub, shard_by_layer};
use tinyvllm_tests::{Coordinator, Log, TempDir, binary, golden, model_dir, post_json, terminate};

const REPO: &str = "org/stories260K";

/// The small files every side fetches (generation_config.json included: the repo has one).
const SMALL_FILES: [&str; 4] = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"];

/// A machine: its hub, its cache, and (for workers) the process.
struct Machine {
    hub: FakeHub,
    home: TempDir,
}

impl Machine {
    fn new(model: &std::path::Path, tag: &str, bytes_per_second: u64) -> Self {
        Self { hub: FakeHub::serve(REPO, model, bytes_per_second), home: TempDir::new(tag) }
    }

    fn env(&self, command: &mut Command) {
        command.env("HF_ENDPOINT", &self.hub.endpoint).env("HF_HOME", &self.home.0).env_remove("HF_TOKEN");
    }
}

struct Worker {
    child: Child,
    log: Log,
}

impl Drop for Worker {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

fn start_worker(cluster: &Coordinator, machine: &Machine, name: &str, secret_file: &std::path::Path) -> Worker {
    let mut command = Command::new(binary("tinyvllm-worker"));
    command
        .args(["serve", "--model", REPO, "--layers", "auto", "--coordinator", &cluster.quic, "--name", name])
        .args(["--kv-cache-memory", "4000000", "--stage-listen", "127.0.0.1:0"])
        .arg("--state-dir")
        .arg(machine.home.0.join("state"))
        .arg("--cluster-secret-file")
        .arg(secret_file)
        .stderr(Stdio::piped());
    machine.env(&mut command);
    let mut child = command.spawn().expect("starting a worker");
    let log = Log::collect(child.stderr.take().expect("piped stderr"));
    Worker { child, log }
}

/// The shards a stage holding `layers` ("FIRST-LAST" of 5) reads of the
/// sharded stories260K: the embeddings' (first stage, and last since they
/// are tied to the lm_head), its layers', and the final norm's (last).
fn shards_of_stage(shards: &[String], layers: &str) -> BTreeSet<String> {
    let (first, last) = layers.split_once('-').expect("FIRST-LAST");
    let (first, last): (usize, usize) = (first.parse().unwrap(), last.parse().unwrap());
    // shards[0] embeddings, shards[1 + n] layer n, shards[6] the final norm.
    let mut wanted: BTreeSet<String> = (first..=last).map(|n| shards[1 + n].clone()).collect();
    if first == 0 || last == 4 {
        wanted.insert(shards[0].clone());
    }
    if last == 4 {
        wanted.insert(shards[6].clone());
    }
    wanted
}

#[test]
fn each_stage_downloads_only_its_shards_and_shows_its_progress() {
    let sharded = TempDir::new("sharded-model");
    let shards = shard_by_layer(&model_dir("stories260K"), &sharded.0);
    assert_eq!(shards.len(), 7, "embeddings, 5 layers, final norm: {shards:?}");

    let coordinator_machine = Machine::new(&sharded.0, "hf-coordinator", 50_000_000);
    let mut command = Command::new(binary("tinyvllm-coordinator"));
    command.args(["--model", REPO, "--pipeline-parallel-size", "2"]);
    coordinator_machine.env(&mut command);
    let (cluster, coordinator_log) = Coordinator::start_command(command);
    // The coordinator reads the config and tokenizer, never the weights.
    let fetched: BTreeSet<String> = coordinator_machine.hub.downloaded().into_iter().collect();
    assert_eq!(fetched, SMALL_FILES.iter().map(|f| f.to_string()).collect(), "the coordinator fetched {fetched:?}");

    // About 1.5 s per worker: slow enough to be seen downloading.
    let machines = [Machine::new(&sharded.0, "hf-a", 400_000), Machine::new(&sharded.0, "hf-b", 400_000)];
    let workers = [
        start_worker(&cluster, &machines[0], "a", &cluster.secret_file),
        start_worker(&cluster, &machines[1], "b", &cluster.secret_file),
    ];

    // Watch /v1/workers until the pipeline is ready.
    let mut seen_downloading: BTreeSet<String> = BTreeSet::new();
    let mut snapshots = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let listed = cluster.workers();
        for p in listed["preparing"].as_array().expect("a preparing list") {
            let name = p["name"].as_str().unwrap().to_string();
            assert_eq!(p["joined_by"], "address", "{p}");
            match p["phase"].as_str() {
                Some("downloading") if p["file"]["bytes_done"].as_u64() < p["file"]["bytes_total"].as_u64() => {
                    assert!(p["files_total"].as_u64().unwrap() >= 5, "{p}");
                    assert!(p["file"]["name"].as_str().is_some_and(|f| !f.is_empty()), "{p}");
                    seen_downloading.insert(name);
                    snapshots.push(p.clone());
                }
                // Loading may be too quick to be seen on so small a model.
                Some("downloading" | "loading") => {}
                other => panic!("phase {other:?}: {p}"),
            }
        }
        if listed["data"].as_array().map(Vec::len) == Some(1) && listed["data"][0]["state"] == "ready" {
            assert_eq!(listed["preparing"], json!([]), "a ready worker is not preparing: {listed}");
            break;
        }
        let logs: Vec<String> = workers.iter().map(|w| w.log.text()).collect();
        assert!(Instant::now() < deadline, "no pipeline formed: {listed}\n{}", logs.join("\n"));
        std::thread::sleep(Duration::from_millis(25));
    }
    assert_eq!(seen_downloading, ["a", "b"].map(String::from).into(), "both stages seen downloading: {snapshots:#?}");
    // Progress moves: a worker's snapshots grow in bytes.
    let bytes_of = |name: &str| -> Vec<u64> {
        snapshots.iter().filter(|p| p["name"] == name).map(|p| p["downloaded_bytes"].as_u64().unwrap()).collect()
    };
    for name in ["a", "b"] {
        let bytes = bytes_of(name);
        assert!(bytes.windows(2).all(|w| w[0] <= w[1]) && bytes.last() > bytes.first(), "{name}: {bytes:?}");
    }

    // Each stage fetched the small files, the index and its own shards: no other.
    let listed = cluster.workers();
    let stages: Vec<(String, String)> = listed["data"][0]["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .map(|s| (s["name"].as_str().unwrap().to_string(), s["layers"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(stages.len(), 2, "{listed}");
    for (name, layers) in &stages {
        let machine = &machines[if name == "a" { 0 } else { 1 }];
        let fetched: Vec<String> = machine.hub.downloaded();
        let unique: BTreeSet<String> = fetched.iter().cloned().collect();
        assert_eq!(unique.len(), fetched.len(), "{name} fetched a file twice: {fetched:?}");
        let weights: BTreeSet<String> = unique.iter().filter(|f| f.ends_with(".safetensors")).cloned().collect();
        assert_eq!(weights, shards_of_stage(&shards, layers), "stage {name} (layers {layers}) fetched {fetched:?}");
        assert!(unique.contains("model.safetensors.index.json") && unique.contains("config.json"), "{fetched:?}");
        let log = workers[if name == "a" { 0 } else { 1 }].log.text();
        let shard = weights.iter().next().unwrap();
        assert!(log.contains(&format!("downloading {REPO}/{shard}")), "{log}");
        assert!(log.contains(&format!("downloaded {REPO}/{shard}")), "{log}");
    }
    assert!(stages.iter().any(|(_, l)| l.starts_with("0-")) && stages.iter().any(|(_, l)| l.ends_with("-4")));
    let coordinator_text = coordinator_log.text();
    assert!(coordinator_text.contains("is fetching and loading layers"), "{coordinator_text}");
    assert!(coordinator_text.contains("has its weights"), "{coordinator_text}");

    // Stages with only their own shards serve the golden tokens exactly.
    for case in golden("stories260K.json")["cases"].as_array().expect("cases") {
        let body = json!({"prompt": case["prompt_text"], "max_tokens": 48, "temperature": 0, "ignore_eos": true});
        let (status, out) = post_json(&cluster.url("/generate"), &body);
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "case {}", case["id"]);
    }

    // The wrong secret: refused with a message before any weights are fetched.
    let stranger_machine = Machine::new(&sharded.0, "hf-stranger", 50_000_000);
    let wrong = TempDir::new("wrong-secret");
    let wrong_secret = wrong.0.join("secret");
    std::fs::write(&wrong_secret, "not-this-cluster's-secret-at-all").unwrap();
    let mut command = Command::new(binary("tinyvllm-worker"));
    command
        .args(["serve", "--model", REPO, "--coordinator", &cluster.quic, "--name", "stranger"])
        .arg("--state-dir")
        .arg(stranger_machine.home.0.join("state"))
        .arg("--cluster-secret-file")
        .arg(&wrong_secret);
    stranger_machine.env(&mut command);
    let out = command.output().expect("running a worker");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("refused this worker"), "{stderr}");
    let fetched = stranger_machine.hub.downloaded();
    assert!(fetched.iter().all(|f| !f.contains("safetensors")), "fetched before it was refused: {fetched:?}");
}
