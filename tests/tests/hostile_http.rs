//! The HTTP front door under hostile clients (issue 31): huge prompts,
//! slow and half-sent requests, over-limit bodies, odd auth headers,
//! prompts longer than the KV cache, shutdown mid-stream, hyper-level
//! errors, and a table of malformed requests. Each case gets a prompt,
//! clean answer, and never slows anyone else. Model: the real stories260K.

use std::io::{BufRead, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, post_json};

/// Sends `request` as raw bytes; returns the status, the head and the body
/// read until the server closes or `wait` passes.
fn raw(addr: &str, request: &[u8], wait: Duration) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_read_timeout(Some(wait)).unwrap();
    let _ = stream.write_all(request);
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                if complete_response(&got) {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&got).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

/// A final (non-1xx) response with its whole `content-length` body is in.
fn complete_response(bytes: &[u8]) -> bool {
    let text = String::from_utf8_lossy(bytes);
    let Some((head, body)) = text.split_once("\r\n\r\n") else { return false };
    if head.starts_with("HTTP/1.1 1") {
        return false;
    }
    let len = head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("content-length").then(|| value.trim().parse::<usize>().ok())?
    });
    len.is_some_and(|len| body.len() >= len)
}

/// GET `path`; the status, or 0 if no answer came within `wait`.
fn get_status(cluster: &Coordinator, path: &str, wait: Duration) -> u16 {
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    raw(&cluster.http, request.as_bytes(), wait).0
}

fn assert_openai_error(body: &str, context: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{context}: body {body:?} is not JSON: {e}"));
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{context}: {v}");
    assert!(e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(), "{context}: {v}");
    v
}

fn greedy(prompt: &str, max_tokens: u64) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

/// A prompt of about `bytes` bytes of ordinary prose.
fn huge_prompt(bytes: usize) -> String {
    let sentence = "Once upon a time, a little dog ran to the park and played with a red ball. ";
    sentence.repeat(bytes / sentence.len())
}

#[test]
fn huge_prompts_stall_neither_health_nor_small_requests_nor_workers() {
    let cluster = Coordinator::start("stories260K", 2, &[]);
    let prompt = huge_prompt(3_900_000);
    let busy: Vec<_> = (0..4)
        .map(|i| {
            let prompt = prompt.clone();
            // /tokenize has no length limit (vLLM's): these are tokenized in full.
            // /v1/completions refuses them before tokenizing.
            let url = cluster.url(if i % 2 == 0 { "/tokenize" } else { "/v1/completions" });
            std::thread::spawn(move || post_json(&url, &json!({"prompt": prompt})))
        })
        .collect();
    let started = Instant::now();
    let mut slowest = Duration::ZERO;
    while busy.iter().any(|h| !h.is_finished()) {
        let t = Instant::now();
        assert_eq!(get_status(&cluster, "/health", Duration::from_secs(10)), 200, "health during huge prompts");
        let (status, out) = post_json(&cluster.url("/generate"), &greedy("Once upon a time", 4));
        assert_eq!(status, 200, "{out}");
        slowest = slowest.max(t.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    for (i, h) in busy.into_iter().enumerate() {
        let (status, out) = h.join().unwrap();
        if i % 2 == 0 {
            assert_eq!(status, 200, "{out}");
            assert!(out["count"].as_u64().unwrap() > 100_000);
        } else {
            assert_eq!(status, 400, "{out}");
            assert!(out["error"]["message"].as_str().unwrap().contains("maximum context length is 512"), "{out}");
        }
    }
    eprintln!("huge prompts took {:?}; slowest /health + /generate {slowest:?}", started.elapsed());
    // Liveness, not speed: a runtime blocked by tokenizing took ~seconds.
    assert!(slowest < Duration::from_secs(2), "a probe took {slowest:?}");
    assert_eq!(cluster.workers()["data"].as_array().unwrap().len(), 2, "no worker was declared lost");
}

#[test]
fn half_sent_requests_neither_starve_health_nor_spin_the_accept_loop() {
    // 128 descriptors: 300 idle connections exceed them, as on a host with a low limit.
    let cluster = Coordinator::start_wrapped(
        &["prlimit", "--nofile=128:128", "--"],
        "stories260K",
        1,
        &["--http-header-timeout-secs", "3"],
    );
    let mut idle: Vec<TcpStream> = (0..300)
        .filter_map(|_| {
            let mut s = TcpStream::connect(&cluster.http).ok()?;
            let _ = s.write_all(b"POST /v1/completions HTT");
            Some(s)
        })
        .collect();
    let t = Instant::now();
    assert_eq!(get_status(&cluster, "/health", Duration::from_secs(5)), 200, "health with 300 half-sent requests");
    assert!(t.elapsed() < Duration::from_secs(2), "health took {:?}", t.elapsed());
    // The accept loop neither spins nor dies: little CPU while they wait.
    let cpu = || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", cluster.child.id())).unwrap();
        let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
    };
    let before = cpu();
    std::thread::sleep(Duration::from_secs(1));
    let ticks = cpu() - before;
    assert!(ticks < 30, "the coordinator used {ticks} ticks of 100 in one idle second");
    // Each was closed to make room for a newer one, or by the header timeout.
    let deadline = Instant::now() + Duration::from_secs(10);
    for (i, s) in idle.iter_mut().enumerate() {
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        s.set_read_timeout(Some(left)).unwrap();
        let mut buf = [0u8; 1024];
        // EOF, a reset, or a refusal before EOF: anything but our timeout.
        let read = s.read(&mut buf);
        assert!(
            !matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut),
            "half-sent request {i} is still open"
        );
    }
    let (status, out) = post_json(&cluster.url("/generate"), &greedy("Once upon a time", 4));
    assert_eq!(status, 200, "{out}");
}

#[test]
fn a_body_that_stops_coming_is_timed_out() {
    let cluster = Coordinator::start("stories260K", 1, &["--http-body-timeout-secs", "1"]);
    let head =
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n";
    let t = Instant::now();
    let (status, _, body) = raw(&cluster.http, format!("{head}{{\"prompt\":").as_bytes(), Duration::from_secs(10));
    assert_eq!(status, 408, "{body}");
    assert_openai_error(&body, "body timeout");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn an_over_limit_content_length_is_refused_at_once() {
    let cluster = Coordinator::start("stories260K", 1, &["--max-body-bytes", "10000"]);
    for expect in ["", "expect: 100-continue\r\n"] {
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             content-length: 5000000\r\n{expect}\r\n"
        );
        let t = Instant::now();
        // The body never comes: the answer must not wait for it.
        let (status, head, body) = raw(&cluster.http, head.as_bytes(), Duration::from_secs(5));
        assert_eq!(status, 413, "{expect:?}: {head}");
        assert!(!head.contains("100 Continue"), "{head}");
        assert!(t.elapsed() < Duration::from_secs(2), "{expect:?}: {:?}", t.elapsed());
        assert_openai_error(&body, "413");
    }
    // A client that sends the whole body first still reads the 413.
    let big = json!({"prompt": "a".repeat(20_000)});
    let (status, out) = post_json(&cluster.url("/v1/completions"), &big);
    assert_eq!(status, 413, "{out}");
}

#[test]
fn the_bearer_scheme_is_case_insensitive_and_targets_need_the_key() {
    let cluster = Coordinator::start("stories260K", 1, &["--api-key", "sekret"]);
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let resp = ureq::get(&cluster.url("/v1/models")).set("Authorization", &format!("{scheme} sekret")).call();
        assert_eq!(resp.map(|r| r.status()).unwrap_or(0), 200, "{scheme}");
    }
    for header in ["Bearer sekre", "Bearer sekret2", "Basic sekret", "sekret", "Bearer", "Bearersekret"] {
        let status = match ureq::get(&cluster.url("/v1/models")).set("Authorization", header).call() {
            Ok(r) => r.status(),
            Err(ureq::Error::Status(code, _)) => code,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(status, 401, "{header:?}");
    }
    let targets = |key: Option<&str>| {
        let mut req = ureq::get(&cluster.url("/v1/prometheus/targets"));
        if let Some(key) = key {
            req = req.set("Authorization", &format!("Bearer {key}"));
        }
        match req.call() {
            Ok(r) => r.status(),
            Err(ureq::Error::Status(code, _)) => code,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(targets(None), 401, "worker addresses need the key");
    assert_eq!(targets(Some("sekret")), 200);
    // Probes stay open.
    assert_eq!(ureq::get(&cluster.url("/health")).call().unwrap().status(), 200);
    assert_eq!(ureq::get(&cluster.url("/metrics")).call().unwrap().status(), 200);
}

#[test]
fn the_kv_cache_bounds_the_context_published_and_enforced() {
    // A cache of a few blocks: far less than the model's 512 positions.
    let cluster = Coordinator::start("stories260K", 1, &["--worker-arg=--kv-cache-memory=200000"]);
    let blocks = cluster.workers()["data"][0]["stats"]["kv_blocks_total"].as_u64().unwrap();
    let context = (blocks * 16).min(512);
    assert!(context < 512, "the test wants a cache smaller than the model: {blocks} blocks");
    let models: Value = ureq::get(&cluster.url("/v1/models")).call().unwrap().into_json().unwrap();
    assert_eq!(models["data"][0]["max_model_len"], context, "{models}");

    let ids = |n: u64| (0..n).map(|i| 10 + i % 400).collect::<Vec<_>>();
    // Longer than the cache: 400 naming the limit, not 503 + Retry-After.
    let (status, out) = post_json(&cluster.url("/v1/completions"), &json!({"prompt": ids(context + 5)}));
    assert_eq!(status, 400, "{out}");
    let message = out["error"]["message"].as_str().unwrap();
    assert!(message.contains(&format!("maximum context length is {context} tokens")), "{message}");
    // Prompt + max_tokens over the cache: vLLM's 400.
    let body = json!({"prompt": ids(context / 2), "max_tokens": context, "ignore_eos": true});
    let (status, out) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 400, "{out}");
    assert_eq!(out["error"]["param"], "max_tokens");
    // What fits runs to max_tokens, never cut by the cache.
    let room = context - context / 2;
    let body = json!({"prompt": ids(context / 2), "max_tokens": room, "ignore_eos": true, "temperature": 0});
    let (status, out) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["usage"]["completion_tokens"], room, "{out}");
    // Without max_tokens, the default (16) shrinks to the room left in the cache.
    let body = json!({"prompt_token_ids": ids(context - 5), "ignore_eos": true, "temperature": 0});
    let (status, out) = post_json(&cluster.url("/generate"), &body);
    assert_eq!(status, 200, "{out}");
    assert_eq!((out["usage"]["completion_tokens"].as_u64(), out["finish_reason"].as_str()), (Some(5), Some("length")));
}

#[test]
fn draining_answers_health_503_and_cut_streams_end_cleanly() {
    // One sequence at a time: 16 choices of 480 tokens outlast the 1 s drain.
    let cluster =
        Coordinator::start("stories260K", 1, &["--shutdown-timeout-secs", "1", "--worker-arg=--max-num-seqs=1"]);
    let stream = |path: &str, body: Value| {
        let resp = ureq::post(&cluster.url(path)).send_json(body).expect("stream");
        std::io::BufReader::new(resp.into_reader())
    };
    let mut chat_like = greedy("Once upon a time", 480);
    chat_like["n"] = json!(16);
    chat_like["stream"] = json!(true);
    let mut completions = stream("/v1/completions", chat_like.clone());
    let mut generate =
        stream("/generate", json!({"prompt": "The dog", "max_tokens": 400, "ignore_eos": true, "stream": true}));
    let mut first = String::new();
    completions.read_line(&mut first).unwrap();
    assert!(first.starts_with("data: "), "{first}");
    std::process::Command::new("kill").args(["-TERM", &cluster.child.id().to_string()]).status().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let resp = ureq::get(&cluster.url("/health")).call();
    let (status, body) = match resp {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
        Err(e) => panic!("{e}"),
    };
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("draining"), "{body}");
    for (name, reader) in [("completions", &mut completions), ("generate", &mut generate)] {
        // Read to the end: a broken chunked transfer is an error here.
        let mut rest = String::new();
        reader.read_to_string(&mut rest).unwrap_or_else(|e| panic!("{name}: the stream broke: {e}"));
        let data: Vec<&str> = rest.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(data.last(), Some(&"[DONE]"), "{name}: {}", &rest[rest.len().saturating_sub(300)..]);
        let error: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
        assert!(error["error"]["message"].as_str().unwrap().contains("shutting down"), "{name}: {error}");
    }
}

#[test]
fn hyper_level_errors_have_json_bodies() {
    let cluster = Coordinator::start("stories260K", 1, &[]);
    let huge_header = format!("GET /health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(100_000));
    let (status, _, body) = raw(&cluster.http, huge_header.as_bytes(), Duration::from_secs(5));
    assert_eq!(status, 431);
    assert_openai_error(&body, "huge header");
    let many: String = (0..150).map(|i| format!("x-h{i}: v\r\n")).collect();
    let (status, _, body) =
        raw(&cluster.http, format!("GET /health HTTP/1.1\r\nhost: x\r\n{many}\r\n").as_bytes(), Duration::from_secs(5));
    assert_eq!(status, 431);
    assert_openai_error(&body, "many headers");
    let long_uri = format!("GET /{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(20_000));
    let (status, _, body) = raw(&cluster.http, long_uri.as_bytes(), Duration::from_secs(5));
    assert_eq!(status, 414);
    assert_openai_error(&body, "long uri");

    // What hyper refuses before any handler of ours runs has our JSON too
    // (issue 58): a head over hyper's buffer, thousands of headers, a URI
    // over hyper's limit, a request line or header that is not HTTP.
    let megabyte_header = format!("GET /health HTTP/1.1\r\nhost: x\r\nx-big: {}\r\n\r\n", "a".repeat(1 << 20));
    let thousands: String = (0..1500).map(|i| format!("x-h{i}: v\r\n")).collect();
    let cases: [(&str, Vec<u8>, u16); 6] = [
        ("a 1 MiB header", megabyte_header.into_bytes(), 431),
        ("1500 headers", format!("GET /health HTTP/1.1\r\nhost: x\r\n{thousands}\r\n").into_bytes(), 431),
        ("a 100 KiB URI", format!("GET /{} HTTP/1.1\r\nhost: x\r\n\r\n", "a".repeat(100_000)).into_bytes(), 414),
        ("GARBAGE", b"GARBAGE\r\n\r\n".to_vec(), 400),
        ("a header without a colon", b"GET /health HTTP/1.1\r\nhost x\r\n\r\n".to_vec(), 400),
        ("a bad method", b"G@T /health HTTP/1.1\r\nhost: x\r\n\r\n".to_vec(), 400),
    ];
    for (name, request, expected) in cases {
        let (status, head, body) = raw(&cluster.http, &request, Duration::from_secs(5));
        assert_eq!(status, expected, "{name}: {head}");
        assert!(head.to_ascii_lowercase().contains("content-type: application/json"), "{name}: {head}");
        assert_openai_error(&body, name);
    }
    // A good request, then garbage on the same connection: the answer to
    // the first as usual, then the refusal with its JSON.
    let mut stream = TcpStream::connect(&cluster.http).expect("connect");
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    stream.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\nGARBAGE\r\n\r\n").unwrap();
    let mut text = String::new();
    let _ = stream.read_to_string(&mut text);
    let second = text.find("HTTP/1.1 400").unwrap_or_else(|| panic!("no 400 after the 200: {text}"));
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    let (_, body) = text[second..].split_once("\r\n\r\n").expect("a head");
    assert_openai_error(body, "garbage after a request");
    // The server is unharmed.
    assert_eq!(get_status(&cluster, "/health", Duration::from_secs(5)), 200);
}

/// (path, body, content type, expected status, expected `param`, a word the message must hold)
type Case = (&'static str, String, &'static str, u16, Option<&'static str>, &'static str);

fn hostile_cases() -> Vec<Case> {
    const J: &str = "application/json";
    let c = |path, body: &str, status, param, word| (path, body.to_string(), J, status, param, word);
    let nested = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let nested_in_field = format!(r#"{{"prompt": "hi", "stop": {}{}}}"#, "[".repeat(5_000), "]".repeat(5_000));
    let many_stops = serde_json::to_string(&json!({"prompt": "hi", "stop": vec!["x"; 100_000]})).unwrap();
    let long_stop = serde_json::to_string(&json!({"prompt": "hi", "stop": "x".repeat(100_000)})).unwrap();
    let bias: serde_json::Map<String, Value> = (0..50_000).map(|i| (i.to_string(), json!(1))).collect();
    let huge_bias = serde_json::to_string(&json!({"prompt": "hi", "logit_bias": bias})).unwrap();
    let long_model = serde_json::to_string(&json!({"prompt": "hi", "model": "m".repeat(100_000)})).unwrap();
    let many_prompts = serde_json::to_string(&json!({"prompt": vec!["hi"; 5000], "max_tokens": 1})).unwrap();
    vec![
        c("/v1/completions", "{not json", 400, None, "JSON"),
        c("/v1/completions", "", 400, None, "JSON"),
        c("/v1/completions", "[]", 400, None, "object"),
        c("/v1/completions", "null", 400, None, "object"),
        c("/v1/completions", r#"{"prompt": 42}"#, 400, Some("prompt"), "prompt"),
        c("/v1/completions", r#"{"prompt": null}"#, 400, Some("prompt"), "prompt"),
        c("/v1/completions", r#"{"prompt": [1, -5]}"#, 400, Some("prompt"), "prompt"),
        c("/v1/completions", r#"{"prompt": [1, 5000000000]}"#, 400, Some("prompt"), "prompt"),
        c("/v1/completions", r#"{"prompt": [1, 99999]}"#, 400, Some("prompt"), "vocabulary"),
        c("/v1/completions", r#"{"prompt": [[1, 2], [99999]]}"#, 400, Some("prompt"), "vocabulary"),
        c("/v1/completions", r#"{"prompt": [1.5]}"#, 400, Some("prompt"), "prompt"),
        c("/v1/completions", r#"{"prompt": []}"#, 400, Some("prompt"), "empty"),
        c("/v1/completions", r#"{"prompt": [[]]}"#, 400, Some("prompt"), "empty"),
        c("/v1/completions", &many_prompts, 400, Some("prompt"), "prompts"),
        c("/v1/completions", r#"{"prompt": "hi", "max_tokens": -1}"#, 400, Some("max_tokens"), "max_tokens"),
        c("/v1/completions", r#"{"prompt": "hi", "max_tokens": 0}"#, 400, Some("max_tokens"), "max_tokens"),
        c("/v1/completions", r#"{"prompt": "hi", "max_tokens": 1e308}"#, 400, Some("max_tokens"), "integer"),
        c("/v1/completions", r#"{"prompt": "hi", "max_tokens": 2.5}"#, 400, Some("max_tokens"), "integer"),
        c("/v1/completions", r#"{"prompt": "hi", "max_tokens": "ten"}"#, 400, Some("max_tokens"), "integer"),
        c(
            "/v1/completions",
            r#"{"prompt": "hi", "max_tokens": 99999999999999999999999}"#,
            400,
            Some("max_tokens"),
            "max_tokens",
        ),
        c("/v1/completions", r#"{"prompt": "hi", "min_tokens": -3}"#, 400, Some("min_tokens"), "[0,"),
        c("/v1/completions", r#"{"prompt": "hi", "temperature": 1e308}"#, 400, Some("temperature"), "[0, 2]"),
        c("/v1/completions", r#"{"prompt": "hi", "temperature": -1}"#, 400, Some("temperature"), "[0, 2]"),
        c("/v1/completions", r#"{"prompt": "hi", "temperature": "hot"}"#, 400, Some("temperature"), "number"),
        c("/v1/completions", r#"{"prompt": "hi", "top_p": 0}"#, 400, Some("top_p"), "(0, 1]"),
        c("/v1/completions", r#"{"prompt": "hi", "top_p": 1e300}"#, 400, Some("top_p"), "(0, 1]"),
        c("/v1/completions", r#"{"prompt": "hi", "top_k": -7}"#, 400, Some("top_k"), "top_k"),
        c("/v1/completions", r#"{"prompt": "hi", "top_k": 1e20}"#, 400, Some("top_k"), "top_k"),
        c("/v1/completions", r#"{"prompt": "hi", "min_p": 5}"#, 400, Some("min_p"), "[0, 1]"),
        c(
            "/v1/completions",
            r#"{"prompt": "hi", "presence_penalty": -1e308}"#,
            400,
            Some("presence_penalty"),
            "[-2, 2]",
        ),
        c("/v1/completions", r#"{"prompt": "hi", "frequency_penalty": 9}"#, 400, Some("frequency_penalty"), "[-2, 2]"),
        c(
            "/v1/completions",
            r#"{"prompt": "hi", "repetition_penalty": 0}"#,
            400,
            Some("repetition_penalty"),
            "(0, 10]",
        ),
        c("/v1/completions", r#"{"prompt": "hi", "seed": 1e30}"#, 400, Some("seed"), "integer"),
        c("/v1/completions", r#"{"prompt": "hi", "seed": "x"}"#, 400, Some("seed"), "integer"),
        c("/v1/completions", r#"{"prompt": "hi", "n": 1000}"#, 400, Some("n"), "[1, 16]"),
        c("/v1/completions", r#"{"prompt": "hi", "n": 0}"#, 400, Some("n"), "[1, 16]"),
        c("/v1/completions", r#"{"prompt": "hi", "logprobs": 100}"#, 400, Some("logprobs"), "[0, 20]"),
        c("/v1/completions", r#"{"prompt": "hi", "stream": "yes"}"#, 400, Some("stream"), "boolean"),
        c("/v1/completions", r#"{"prompt": "hi", "echo": 1}"#, 400, Some("echo"), "boolean"),
        c("/v1/completions", r#"{"prompt": "hi", "stop": 5}"#, 400, Some("stop"), "stop"),
        c("/v1/completions", r#"{"prompt": "hi", "stop": [""]}"#, 400, Some("stop"), "empty"),
        c("/v1/completions", &many_stops, 400, Some("stop"), "stop"),
        c("/v1/completions", &long_stop, 400, Some("stop"), "stop"),
        c("/v1/completions", r#"{"prompt": "hi", "stop_token_ids": [-1]}"#, 400, Some("stop_token_ids"), "token"),
        c(
            "/v1/completions",
            r#"{"prompt": "hi", "stop_token_ids": [99999]}"#,
            400,
            Some("stop_token_ids"),
            "vocabulary",
        ),
        c("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"x": 1}}"#, 400, Some("logit_bias"), "token id"),
        c("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"5": 1e308}}"#, 400, Some("logit_bias"), "[-100, 100]"),
        c("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"5": "x"}}"#, 400, Some("logit_bias"), "number"),
        c("/v1/completions", r#"{"prompt": "hi", "logit_bias": [1]}"#, 400, Some("logit_bias"), "object"),
        c("/v1/completions", &huge_bias, 400, Some("logit_bias"), "logit_bias"),
        c("/v1/completions", &nested, 400, None, "JSON"),
        c("/v1/completions", &nested_in_field, 400, None, "JSON"),
        c("/v1/completions", r#"{"prompt": "hi", "model": 7}"#, 400, Some("model"), "string"),
        c("/v1/completions", r#"{"prompt": "hi", "model": "gpt-9"}"#, 404, Some("model"), "gpt-9"),
        c("/v1/completions", &long_model, 404, Some("model"), "..."),
        c("/v1/completions", r#"{"prompt": "hi", "logprobs": true}"#, 400, Some("logprobs"), "integer"),
        c("/v1/completions", r#"{"prompt": "hi", "tools": "x"}"#, 400, Some("tools"), "array"),
        c("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"5": 1, "05": 2}}"#, 400, Some("logit_bias"), "twice"),
        c("/v1/completions", r#"{"prompt": "hi", "stream_options": 3}"#, 400, Some("stream_options"), "object"),
        c(
            "/v1/completions",
            r#"{"prompt": "hi", "stream": true, "stream_options": {"include_usage": "yes"}}"#,
            400,
            Some("stream_options"),
            "boolean",
        ),
        c("/v1/chat/completions", r#"{"messages": []}"#, 400, Some("messages"), "empty"),
        c("/v1/chat/completions", r#"{"messages": "hi"}"#, 400, Some("messages"), "array"),
        c("/v1/chat/completions", r#"{}"#, 400, Some("messages"), "messages"),
        c("/v1/chat/completions", r#"{"messages": [42]}"#, 400, Some("messages"), "object"),
        c("/v1/chat/completions", r#"{"messages": [{"content": "hi"}]}"#, 400, Some("messages"), "role"),
        c(
            "/v1/chat/completions",
            r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#,
            400,
            Some("messages"),
            "wizard",
        ),
        c(
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": 5}]}"#,
            400,
            Some("messages"),
            "content",
        ),
        c(
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}"#,
            400,
            Some("logprobs"),
            "boolean",
        ),
        c("/generate", r#"{"prompt_token_ids": [1, 99999]}"#, 400, Some("prompt"), "vocabulary"),
        c("/generate", r#"{"prompt_token_ids": "abc"}"#, 400, Some("prompt_token_ids"), "token"),
        c("/generate", r#"{"prompt": ["a"]}"#, 400, Some("prompt"), "string"),
        c("/generate", r#"{}"#, 400, Some("prompt"), "prompt"),
        c("/tokenize", r#"{"prompt": 5}"#, 400, Some("prompt"), "string"),
        c("/detokenize", r#"{"tokens": [99999]}"#, 400, Some("tokens"), "vocabulary"),
        c("/detokenize", r#"{"tokens": [-1]}"#, 400, Some("tokens"), "token"),
        ("/v1/completions", r#"{"prompt": "hi"}"#.into(), "text/plain", 415, None, "application/json"),
        c("/nope", "{}", 404, None, "/nope"),
    ]
}

#[test]
fn a_table_of_hostile_requests_gets_clean_4xx_and_disturbs_no_one() {
    let cluster = Coordinator::start("stories260K", 1, &[]);
    let url = cluster.url("/v1/completions");
    let reference = post_json(&url, &greedy("Once upon a time", 300)).1["choices"][0]["text"].clone();
    let good = std::thread::spawn(move || {
        let mut body = greedy("Once upon a time", 300);
        body["stream"] = json!(true);
        tinyvllm_tests::post_sse(&url, &body)
    });
    for (path, body, content_type, status, param, word) in hostile_cases() {
        let shown = &body[..body.len().min(80)];
        let request = ureq::post(&cluster.url(path)).set("content-type", content_type);
        let (got, text) = match request.send_bytes(body.as_bytes()) {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap_or_default()),
            Err(e) => panic!("{path} {shown}: {e}"),
        };
        assert_eq!(got, status, "{path} {shown}: {text}");
        let err = assert_openai_error(&text, shown);
        if let Some(param) = param {
            assert_eq!(err["error"]["param"], param, "{path} {shown}: {err}");
        }
        let message = err["error"]["message"].as_str().unwrap();
        assert!(message.contains(word), "{path} {shown}: {message:?} lacks {word:?}");
    }
    // Invalid UTF-8 in a string.
    let mut bytes = br#"{"prompt": "hi "#.to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe]);
    bytes.extend_from_slice(br#""}"#);
    let err = ureq::post(&cluster.url("/v1/completions")).set("content-type", "application/json").send_bytes(&bytes);
    let Err(ureq::Error::Status(400, r)) = err else { panic!("invalid UTF-8 accepted") };
    assert_openai_error(&r.into_string().unwrap(), "invalid utf-8");

    let (events, done) = good.join().unwrap();
    assert!(done, "the good stream ended with [DONE]");
    let text: String = events.iter().filter_map(|e| e["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(Value::String(text), reference, "the good stream is exact");
}

#[test]
fn a_stream_longer_than_the_header_timeout_is_not_cut() {
    // The head timeout is for heads: a response streaming for longer runs on.
    let cluster =
        Coordinator::start("stories260K", 1, &["--http-header-timeout-secs", "1", "--worker-arg=--max-num-seqs=1"]);
    let mut body = greedy("Once upon a time", 480);
    body["n"] = json!(16);
    body["stream"] = json!(true);
    let started = Instant::now();
    let (events, done) = tinyvllm_tests::post_sse(&cluster.url("/v1/completions"), &body);
    let elapsed = started.elapsed();
    assert!(done, "the stream ended with [DONE]");
    let ended = events.iter().filter(|e| e["choices"].get(0).is_some_and(|c| c["finish_reason"] == "length")).count();
    assert_eq!(ended, 16, "every choice ran to max_tokens");
    assert!(elapsed > Duration::from_secs(1), "the stream took {elapsed:?}, not longer than the timeout");
}
