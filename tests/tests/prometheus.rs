//! The observability stack for real: a cluster, a real Prometheus (Debian's
//! `prometheus` package, installed by `.ci/run`) scraping it with the
//! shipped `deploy/prometheus/prometheus.yml` (workers found through the
//! coordinator's http_sd endpoint), live traffic, then every PromQL
//! expression of the shipped Grafana dashboard must return data. Two
//! replicas and a two-stage pipeline serve, so the pipeline row has data too.
//!
//! Outside CI the test is skipped when no `prometheus` binary is on PATH.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, TempDir, binary, model_dir, post_json, repo_root, terminate};

fn prometheus_binary() -> Option<String> {
    let found = Command::new("prometheus").arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status();
    match found {
        Ok(s) if s.success() => Some("prometheus".into()),
        _ if std::env::var_os("CI").is_some() => panic!("CI must provide prometheus (.ci/run installs it)"),
        _ => None,
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

/// Every `expr` in the dashboard, rows included.
fn dashboard_exprs() -> Vec<(String, String)> {
    let path = repo_root().join("deploy/grafana/dashboards/tinyvllm-cluster.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).expect("dashboard")).expect("json");
    let mut out = Vec::new();
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?").to_string();
            for target in panel["targets"].as_array().into_iter().flatten() {
                if let Some(expr) = target["expr"].as_str() {
                    out.push((title.clone(), expr.to_string()));
                }
            }
            walk(&panel["panels"], out);
        }
    }
    walk(&dashboard["panels"], &mut out);
    out
}

fn query(prom: &str, expr: &str) -> Value {
    let url = format!("http://{prom}/api/v1/query");
    ureq::get(&url).query("query", expr).call().expect("Prometheus query").into_json().expect("json")
}

/// Keeps a mix of traffic going: shared-prefix completions (cache hits),
/// streams (inter-token latency), chat-free /generate (some speculating),
/// and bad requests (errors).
fn traffic(cluster_http: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let url = |p: &str| format!("http://{cluster_http}{p}");
        let prefix: Vec<u32> = (0..64).map(|i| 3 + (i * 11) % 500).collect();
        let mut i = 0u32;
        while !stop.load(Ordering::Relaxed) {
            let mut ids = prefix.clone();
            ids.extend([10 + i % 400, 11, 12]);
            let body = json!({"prompt": ids, "max_tokens": 12, "temperature": 0, "ignore_eos": true, "stream": i.is_multiple_of(2)});
            let _ = ureq::post(&url("/v1/completions")).send_json(body).map(|r| r.into_string());
            let _ = post_json(&url("/generate"), &json!({"prompt": "Once upon a time", "max_tokens": 8}));
            // n-gram speculation on a prompt the output repeats (the acceptance panel).
            let story = "Once upon a time, there was a little girl. Once upon a time, there was a little";
            let spec = json!({"method": "ngram"});
            let _ = post_json(&url("/generate"), &json!({"prompt": story, "max_tokens": 16, "speculative": spec}));
            let _ = ureq::post(&url("/v1/completions")).send_json(json!({"prompt": "x", "max_tokens": -1}));
            i += 1;
        }
    })
}

#[test]
fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    let Some(prometheus) = prometheus_binary() else {
        eprintln!("skipped: no prometheus binary (apt-get install prometheus)");
        return;
    };
    let cluster = Coordinator::start("stories260K", 2, &[]);
    let dir = TempDir::new("prometheus");
    let mut pipeline = start_pipeline(&cluster, &dir);
    cluster.wait_for_workers(3);
    // The shipped config, pointed at this cluster and scraping every second.
    let shipped = std::fs::read_to_string(repo_root().join("deploy/prometheus/prometheus.yml")).expect("config");
    let config = shipped.replace("localhost:8080", &cluster.http).replace("scrape_interval: 5s", "scrape_interval: 1s");
    assert_ne!(config, shipped, "the shipped config must name localhost:8080 and a 5s interval");
    let config_path = dir.0.join("prometheus.yml");
    std::fs::write(&config_path, config.replace("refresh_interval: 10s", "refresh_interval: 1s")).expect("write");
    let prom = format!("127.0.0.1:{}", free_port());
    let mut server = Command::new(prometheus)
        .arg(format!("--config.file={}", config_path.display()))
        .arg(format!("--storage.tsdb.path={}", dir.0.join("data").display()))
        .arg(format!("--web.listen-address={prom}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting prometheus");

    let stop = Arc::new(AtomicBool::new(false));
    let load = traffic(cluster.http.clone(), stop.clone());
    // Wait for the coordinator and both workers (found through http_sd) to be up.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let up = ureq::get(&format!("http://{prom}/api/v1/query"))
            .query("query", "sum(up)")
            .call()
            .ok()
            .and_then(|r| r.into_json::<Value>().ok())
            .and_then(|v| v["data"]["result"][0]["value"][1].as_str().map(str::to_string));
        // The coordinator, two replicas, and the pipeline's two stages.
        if up.as_deref() == Some("5") {
            break;
        }
        assert!(Instant::now() < deadline, "targets never came up: {up:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
    // Enough samples for rate() over [1m] windows, under live traffic.
    std::thread::sleep(Duration::from_secs(8));

    let exprs = dashboard_exprs();
    assert!(exprs.len() >= 15, "the dashboard has {} queries", exprs.len());
    let mut empty = Vec::new();
    for (title, expr) in &exprs {
        let v = query(&prom, expr);
        assert_eq!(v["status"], "success", "{title}: {expr}: {v}");
        if v["data"]["result"].as_array().is_none_or(|r| r.is_empty()) {
            empty.push(format!("{title}: {expr}"));
        }
    }
    // Series per worker: both workers' KV usage is there.
    let kv = query(&prom, "vllm:kv_cache_usage_perc");
    let workers: BTreeSet<&str> =
        kv["data"]["result"].as_array().into_iter().flatten().filter_map(|s| s["metric"]["worker"].as_str()).collect();
    stop.store(true, Ordering::Relaxed);
    let _ = load.join();
    terminate(&mut server);
    for stage in &mut pipeline {
        terminate(stage);
    }
    assert!(empty.is_empty(), "queries without data:\n{}", empty.join("\n"));
    assert_eq!(workers.len(), 3, "{kv}");
}

/// A two-stage pipeline of stories260K joining `cluster`, each stage with
/// a metrics endpoint; the later stage first, then the first dialling it.
fn start_pipeline(cluster: &Coordinator, dir: &TempDir) -> Vec<std::process::Child> {
    let model = model_dir("stories260K");
    let address_file = dir.0.join("stage-1.addr");
    let stage = |layers: &str, name: &str| {
        let mut command = Command::new(binary("tinyvllm-worker"));
        command
            .args(["serve", "--model", model.to_str().unwrap(), "--layers", layers, "--name", name])
            .args(["--metrics", "127.0.0.1:0", "--kv-cache-memory", "4000000"])
            .arg("--cluster-secret-file")
            .arg(&cluster.secret_file)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        command
    };
    let mut later = stage("3-4", "pipeline-stage-1")
        .args(["--stage-listen", "127.0.0.1:0"])
        .arg("--stage-address-file")
        .arg(&address_file)
        .spawn()
        .expect("starting the later stage");
    let deadline = Instant::now() + Duration::from_secs(60);
    let address = loop {
        if let Ok(address) = std::fs::read_to_string(&address_file) {
            break address;
        }
        if Instant::now() > deadline {
            terminate(&mut later);
            panic!("the later stage never listened");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let first = stage("0-2", "pipeline")
        .args(["--next-stage", &address, "--coordinator", &cluster.quic])
        .spawn()
        .expect("starting the first stage");
    vec![first, later]
}

/// Every metric the observability issue lists, with its type and labels.
#[test]
fn worker_and_coordinator_metrics_have_the_documented_names_types_and_labels() {
    let cluster = Coordinator::start("stories260K", 1, &[]);
    let (status, _) = post_json(&cluster.url("/generate"), &json!({"prompt": "Once upon a time", "max_tokens": 8}));
    assert_eq!(status, 200);
    let targets: Value =
        ureq::get(&cluster.url("/v1/prometheus/targets")).call().expect("targets").into_json().expect("json");
    let worker = targets[0]["targets"][0].as_str().expect("a worker target").to_string();
    let scrape = |url: String| ureq::get(&url).call().expect("scrape").into_string().expect("text");
    let worker_text = scrape(format!("http://{worker}/metrics"));
    for (name, kind) in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prefix_cache_queries_total", "counter"),
        ("vllm:prefix_cache_hits_total", "counter"),
        ("vllm:num_preemptions_total", "counter"),
        ("vllm:prompt_tokens_total", "counter"),
        ("vllm:generation_tokens_total", "counter"),
        ("vllm:request_success_total", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
        ("vllm:request_queue_time_seconds", "histogram"),
        ("vllm:request_prefill_time_seconds", "histogram"),
        ("vllm:request_decode_time_seconds", "histogram"),
        ("vllm:iteration_tokens_total", "histogram"),
        ("vllm:spec_decode_num_drafts_total", "counter"),
        ("vllm:spec_decode_num_draft_tokens_total", "counter"),
        ("vllm:spec_decode_num_accepted_tokens_total", "counter"),
        ("vllm:cache_config_info", "gauge"),
        ("tinyvllm_kv_cache_capacity_tokens", "gauge"),
        ("process_resident_memory_bytes", "gauge"),
        ("process_cpu_seconds_total", "counter"),
    ] {
        assert!(worker_text.contains(&format!("# TYPE {name} {kind}\n")), "{name} {kind}");
        if name.starts_with("vllm:") {
            let sample = if kind == "histogram" { format!("{name}_count{{") } else { format!("{name}{{") };
            let line = worker_text.lines().find(|l| l.starts_with(&sample)).unwrap_or_else(|| panic!("{sample}"));
            assert!(line.contains("model_name=\"stories260K\"") && line.contains("worker=\"local-0\""), "{line}");
        }
    }
    assert!(worker_text.contains("vllm:request_success_total{finished_reason=\"length\""), "{worker_text}");
    let coordinator_text = scrape(cluster.url("/metrics"));
    for (name, kind) in [
        ("tinyvllm_http_requests_total", "counter"),
        ("tinyvllm_time_to_first_token_seconds", "histogram"),
        ("tinyvllm_e2e_request_latency_seconds", "histogram"),
        ("tinyvllm_queue_depth", "gauge"),
        ("tinyvllm_requests_in_flight", "gauge"),
        ("tinyvllm_workers", "gauge"),
        ("tinyvllm_router_decisions_total", "counter"),
        ("tinyvllm_router_predicted_cached_tokens_total", "counter"),
        ("tinyvllm_router_actual_cached_tokens_total", "counter"),
        ("tinyvllm_redispatches_total", "counter"),
        ("tinyvllm_rejected_requests_total", "counter"),
    ] {
        assert!(coordinator_text.contains(&format!("# TYPE {name} {kind}\n")), "{name} {kind}\n{coordinator_text}");
    }
    assert!(coordinator_text.contains("tinyvllm_router_decisions_total{policy=\"prefix_aware\",worker=\"local-0\"} 1"));
    assert!(coordinator_text.contains("tinyvllm_workers{state=\"ready\"} 1"));
}
