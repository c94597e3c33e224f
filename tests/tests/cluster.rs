//! The whole cluster as users run it: a coordinator process, workers over
//! QUIC on loopback, HTTP clients. Model: the real stories260K.

use std::io::{BufRead, Read};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tinyvllm_tests::{
    Coordinator, TempDir, golden, plan_device, post_json, post_sse, stream_completion_text, terminate,
};

fn cases() -> Vec<Value> {
    golden("stories260K.json")["cases"].as_array().expect("cases").clone()
}

fn greedy(prompt: &str, max_tokens: u64) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

#[test]
fn two_workers_reproduce_the_golden_tokens_streamed_or_not() {
    let cluster = Coordinator::start("stories260K", 2, &[]);
    for case in cases() {
        let prompt = case["prompt_text"].as_str().unwrap();
        let (status, out) = post_json(&cluster.url("/generate"), &greedy(prompt, 48));
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "case {}", case["id"]);
        assert_eq!(out["usage"]["completion_tokens"], 48);
        assert!(out["worker"].as_str().unwrap().starts_with("local-"));

        let (status, completion) = post_json(&cluster.url("/v1/completions"), &greedy(prompt, 48));
        assert_eq!(status, 200);
        let text = completion["choices"][0]["text"].as_str().unwrap().to_string();
        assert_eq!(text, out["text"].as_str().unwrap(), "case {}", case["id"]);
        assert_eq!(completion["choices"][0]["finish_reason"], "length");
        assert_eq!(completion["usage"]["prompt_tokens"], case["prompt_ids"].as_array().unwrap().len());

        let mut body = greedy(prompt, 48);
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (events, done) = post_sse(&cluster.url("/v1/completions"), &body);
        assert!(done, "stream ended with [DONE]");
        let streamed: String = events.iter().filter_map(|e| e["choices"].get(0)?["text"].as_str()).collect();
        assert_eq!(streamed, text, "streamed == non-streamed for {}", case["id"]);
        assert_eq!(events.last().unwrap()["usage"]["completion_tokens"], 48);
    }
}

/// A worker serving on the Metal step plan in the CPU emulator (what a Mac
/// runs, every dispatch executed) joins over QUIC and streams the golden
/// tokens through the coordinator.
#[test]
fn a_metal_emulated_worker_streams_the_golden_tokens() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let mut worker =
        cluster.start_worker_with("stories260K", "emulated-mac", &cluster.secret_file, &["--device", plan_device()]);
    cluster.wait_for_workers(1);
    let workers = cluster.workers();
    let listed = workers["data"].as_array().or_else(|| workers.as_array()).cloned().unwrap_or_default();
    assert!(workers.to_string().contains(plan_device()), "the worker names its device: {listed:?}");
    for case in cases() {
        let prompt = case["prompt_text"].as_str().unwrap();
        let (status, out) = post_json(&cluster.url("/generate"), &greedy(prompt, 48));
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "case {}", case["id"]);
        let mut body = greedy(prompt, 48);
        body["stream"] = json!(true);
        let (events, done) = post_sse(&cluster.url("/v1/completions"), &body);
        assert!(done, "stream ended with [DONE]");
        let streamed: String = events.iter().filter_map(|e| e["choices"].get(0)?["text"].as_str()).collect();
        assert_eq!(streamed, out["text"].as_str().unwrap(), "case {}", case["id"]);
    }
    terminate(&mut worker);
}

#[test]
fn thirty_two_concurrent_streams_all_complete() {
    let cluster = Coordinator::start("stories260K", 2, &[]);
    let prompts = ["Once upon a time", "The dog", "Lily and Ben", "One day, a big"];
    let expected: Vec<String> = prompts
        .iter()
        .map(|p| {
            post_json(&cluster.url("/v1/completions"), &greedy(p, 40)).1["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let handles: Vec<_> = (0..32)
        .map(|i| {
            let url = cluster.url("/v1/completions");
            let prompt = prompts[i % prompts.len()];
            std::thread::spawn(move || {
                let mut body = greedy(prompt, 40);
                body["stream"] = json!(true);
                let (events, done) = post_sse(&url, &body);
                assert!(done);
                events.iter().filter_map(|e| e["choices"].get(0)?["text"].as_str()).collect::<String>()
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), expected[i % prompts.len()], "stream {i}");
    }
}

#[test]
fn killing_a_worker_mid_stream_loses_and_repeats_nothing() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let mut a = cluster.start_worker("stories260K", "a", &cluster.secret_file);
    let mut b = cluster.start_worker("stories260K", "b", &cluster.secret_file);
    cluster.wait_for_workers(2);
    let prompts: Vec<String> =
        (0..8).map(|i| format!("Once upon a time, there was a {}", ["dog", "cat", "girl", "boy"][i % 4])).collect();
    let reference: Vec<String> = prompts
        .iter()
        .map(|p| {
            post_json(&cluster.url("/v1/completions"), &greedy(p, 300)).1["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    // Start 8 streams, wait until all have produced text, then kill -9 one worker.
    let (tx, rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (url, tx, body) = (cluster.url("/v1/completions"), tx.clone(), greedy(p, 300));
            std::thread::spawn(move || stream_completion_text(&url, body, tx))
        })
        .collect();
    for _ in 0..8 {
        rx.recv_timeout(Duration::from_secs(60)).expect("every stream started");
    }
    a.kill().unwrap(); // SIGKILL
    a.wait().unwrap();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), reference[i], "stream {i} after the kill");
    }
    // The loss is noticed within 3 stats intervals even if no stream was on it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.workers()["data"].as_array().unwrap().len() != 1 {
        assert!(Instant::now() < deadline, "the killed worker is still listed");
        std::thread::sleep(Duration::from_millis(100));
    }
    terminate(&mut b);
}

#[test]
fn a_client_disconnect_frees_its_blocks() {
    let cluster = Coordinator::start("stories260K", 1, &[]);
    let mut body = greedy("Once upon a time", 450);
    body["stream"] = json!(true);
    let resp = ureq::post(&cluster.url("/v1/completions")).send_json(body).unwrap();
    let mut reader = resp.into_reader();
    let mut first = [0u8; 64];
    reader.read_exact(&mut first).unwrap();
    let used = |c: &Coordinator| c.workers()["data"][0]["stats"]["kv_blocks_used"].as_u64().unwrap();
    let in_flight = |c: &Coordinator| c.workers()["in_flight"].as_u64().unwrap();
    assert_eq!(in_flight(&cluster), 1);
    drop(reader); // hang up
    let deadline = Instant::now() + Duration::from_secs(10);
    while (in_flight(&cluster) > 0 || used(&cluster) > 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(in_flight(&cluster), 0, "request still in flight");
    assert_eq!(used(&cluster), 0, "blocks still held");
}

#[test]
fn bad_input_gets_openai_errors_and_disturbs_no_one() {
    let cluster = Coordinator::start("stories260K", 1, &["--api-key", "sekret", "--max-body-bytes", "10000"]);
    let url = cluster.url("/v1/completions");
    // A well-formed request streams concurrently with all the bad ones.
    let good = {
        let url = url.clone();
        std::thread::spawn(move || {
            ureq::post(&url)
                .set("Authorization", "Bearer sekret")
                .send_json(greedy("Once upon a time", 200))
                .map(|r| r.into_json::<Value>().unwrap())
                .map_err(Box::new)
        })
    };
    let send = |path: &str, body: &str, key: Option<&str>| -> (u16, Value) {
        let mut req = ureq::post(&cluster.url(path)).set("content-type", "application/json");
        if let Some(key) = key {
            req = req.set("Authorization", &format!("Bearer {key}"));
        }
        match req.send_string(body) {
            Ok(r) => (r.status(), r.into_json().unwrap()),
            Err(ureq::Error::Status(code, r)) => (code, r.into_json().unwrap_or(Value::Null)),
            Err(e) => panic!("{e}"),
        }
    };
    let key = Some("sekret");
    let long_prompt = format!(r#"{{"prompt": {}, "max_tokens": 5}}"#, serde_json::to_string(&vec![1u32; 600]).unwrap());
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(20_000));
    // (path, body, API key, expected status, expected `param`)
    type Case<'a> = (&'a str, String, Option<&'a str>, u16, Option<&'a str>);
    let cases: Vec<Case> = vec![
        ("/v1/completions", "{not json".into(), key, 400, None),
        ("/v1/completions", r#"{"prompt": 42}"#.into(), key, 400, None),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": -1}"#.into(), key, 400, Some("max_tokens")),
        ("/v1/completions", r#"{"prompt": "hi", "temperature": -1}"#.into(), key, 400, Some("temperature")),
        ("/v1/completions", r#"{"prompt": "hi", "top_p": 0}"#.into(), key, 400, Some("top_p")),
        ("/v1/completions", r#"{"prompt": "hi", "top_p": 1.5}"#.into(), key, 400, Some("top_p")),
        ("/v1/completions", long_prompt, key, 400, Some("prompt")),
        // 2 + 600 tokens do not fit stories260K's 512: refused, not cut short.
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 600}"#.into(), key, 400, Some("max_tokens")),
        ("/generate", r#"{"prompt": "hi", "max_tokens": 600}"#.into(), key, 400, Some("max_tokens")),
        (
            "/v1/completions",
            r#"{"prompt": "hi", "response_format": {"type": "yaml"}}"#.into(),
            key,
            400,
            Some("response_format"),
        ),
        ("/v1/completions", r#"{"prompt": "hi", "best_of": 4}"#.into(), key, 400, Some("best_of")),
        ("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"600": 5}}"#.into(), key, 400, Some("logit_bias")),
        ("/v1/completions", r#"{"prompt": "hi", "logit_bias": {"60": 500}}"#.into(), key, 400, Some("logit_bias")),
        ("/v1/completions", r#"{"prompt": "hi", "model": "gpt-9"}"#.into(), key, 404, Some("model")),
        ("/v1/completions", big, key, 413, None),
        ("/v1/completions", r#"{"prompt": "hi"}"#.into(), None, 401, None),
        ("/v1/completions", r#"{"prompt": "hi"}"#.into(), Some("wrong"), 401, None),
        ("/v1/chat/completions", r#"{"messages": [{"role": "user", "content": "hi"}]}"#.into(), key, 400, None),
        ("/generate", r#"{"prompt_token_ids": [1, 99999]}"#.into(), key, 400, Some("prompt")),
        ("/nope", "{}".into(), key, 404, None),
    ];
    for (path, body, key, status, param) in cases {
        let (got, err) = send(path, &body, key);
        assert_eq!(got, status, "{path} {}: {err}", &body[..body.len().min(60)]);
        let e = &err["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{err}");
        assert!(e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(), "{err}");
        if let Some(param) = param {
            assert_eq!(e["param"], param, "{err}");
        }
    }
    // logit_bias reaches the sampler: +100 on token 300 makes it the only pick.
    let biased = r#"{"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logit_bias": {"300": 100}}"#;
    let (got, body) = send("/generate", biased, key);
    assert_eq!((got, body["token_ids"].clone()), (200, serde_json::json!([300, 300, 300, 300])), "{body}");
    // Without max_tokens, the default (16) shrinks to the 2 tokens left.
    let near_full =
        format!(r#"{{"prompt": {}, "ignore_eos": true}}"#, serde_json::to_string(&vec![1u32; 510]).unwrap());
    let (got, body) = send("/v1/completions", &near_full, key);
    assert_eq!(got, 200, "{body}");
    assert_eq!(
        (body["usage"]["completion_tokens"].as_u64(), body["choices"][0]["finish_reason"].as_str()),
        (Some(2), Some("length"))
    );
    let good = good.join().unwrap().expect("the concurrent request succeeded");
    assert_eq!(good["usage"]["completion_tokens"], 200);
}

#[test]
fn too_many_queued_requests_get_429_with_retry_after() {
    let cluster = Coordinator::start("stories260K", 1, &["--max-queued-requests", "2"]);
    let url = cluster.url("/v1/completions");
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || post_json(&url, &greedy("Once upon a time", 450)).0)
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while cluster.workers()["in_flight"].as_u64() != Some(2) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    match ureq::post(&url).send_json(greedy("hi", 5)) {
        Err(ureq::Error::Status(429, resp)) => assert!(resp.header("retry-after").is_some()),
        other => panic!("expected 429, got {:?}", other.map(|r| r.status())),
    }
    for h in slow {
        assert_eq!(h.join().unwrap(), 200);
    }
}

#[test]
fn a_worker_with_the_wrong_secret_is_refused() {
    let cluster = Coordinator::start("stories260K", 0, &[]);
    let dir = TempDir::new("wrong-secret");
    let wrong = dir.0.join("secret");
    std::fs::write(&wrong, "not-the-secret-of-this-cluster").unwrap();
    let mut worker = cluster.start_worker("stories260K", "intruder", &wrong);
    let status = worker.wait().unwrap();
    assert!(!status.success());
    let mut stderr = String::new();
    worker.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(stderr.contains("wrong cluster secret"), "{stderr}");
    assert_eq!(cluster.workers()["data"].as_array().unwrap().len(), 0);
    assert_eq!(
        ureq::get(&cluster.url("/health")).call().map(|r| r.status()).unwrap_or_else(|e| match e {
            ureq::Error::Status(c, _) => c,
            _ => 0,
        }),
        503
    );
}

#[test]
fn workers_reconnect_when_the_coordinator_restarts() {
    use std::process::Command;
    let mut first = Coordinator::start("stories260K", 0, &[]);
    let mut worker = first.start_worker("stories260K", "w", &first.secret_file);
    first.wait_for_workers(1);
    // Warm the worker's prefix cache with 12 full blocks.
    let prefix: Vec<u32> = (0..200).map(|i| 3 + (i * 7) % 500).collect();
    let with_suffix = |s: u32| -> Value {
        let mut ids = prefix.clone();
        ids.extend([s, s + 1, s + 2]);
        json!({"prompt": ids, "max_tokens": 2, "temperature": 0})
    };
    let (status, _) = post_json(&first.url("/v1/completions"), &with_suffix(10));
    assert_eq!(status, 200);
    // Keep the secret across the restart, as a real deployment does.
    let dir = TempDir::new("restart");
    let secret = dir.0.join("secret");
    std::fs::copy(&first.secret_file, &secret).unwrap();
    let quic = first.quic.clone();
    first.child.kill().unwrap(); // a crash, not a drain
    first.child.wait().unwrap();
    // A new coordinator on the same QUIC address.
    let mut second = Command::new(tinyvllm_tests::binary("tinyvllm-coordinator"))
        .args([
            "--model",
            tinyvllm_tests::model_dir("stories260K").to_str().unwrap(),
            "--http",
            "127.0.0.1:0",
            "--quic",
            &quic,
        ])
        .arg("--cluster-secret-file")
        .arg(&secret)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(second.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let http = line.split_whitespace().find_map(|w| w.strip_prefix("http=")).unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut ready = false;
    while Instant::now() < deadline && !ready {
        ready = ureq::get(&format!("http://{http}/health")).call().is_ok();
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(ready, "the worker did not come back");
    let (status, out) = post_json(&format!("http://{http}/generate"), &greedy("Once upon a time", 8));
    assert_eq!(status, 200, "{out}");
    // The new coordinator learned the warm cache from the worker's snapshot:
    // it predicts the hit, and the worker reports it.
    let (status, out) = post_json(&format!("http://{http}/v1/completions"), &with_suffix(20));
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["cached_tokens"], 192, "{out}");
    let metrics = ureq::get(&format!("http://{http}/metrics")).call().unwrap();
    // Prometheus 3 refuses a scrape that is not in its text format.
    assert_eq!(metrics.header("content-type"), Some("text/plain; version=0.0.4; charset=utf-8"));
    let metrics = metrics.into_string().unwrap();
    let predicted: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("tinyvllm_router_predicted_cached_tokens_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(predicted, 192.0, "{metrics}");
    terminate(&mut second);
    terminate(&mut worker);
}

/// vLLM's `/tokenize` and `/detokenize`: the ids a prompt or a conversation
/// becomes are the ones generation counts, and ids decode back to the text.
#[test]
fn tokenize_and_detokenize_agree_with_generation() {
    let cluster = Coordinator::start("tiny-qwen3", 1, &[]);
    let prompt = "Once upon a time, a tiny model";
    let (status, tok) = post_json(&cluster.url("/tokenize"), &json!({"prompt": prompt, "return_token_strs": true}));
    assert_eq!(status, 200, "{tok}");
    let ids = tok["tokens"].as_array().unwrap().clone();
    assert_eq!(tok["count"], ids.len());
    assert_eq!(tok["max_model_len"], 1024);
    assert_eq!(tok["token_strs"].as_array().map(Vec::len), Some(ids.len()));
    let (_, completion) = post_json(&cluster.url("/v1/completions"), &greedy(prompt, 2));
    assert_eq!(completion["usage"]["prompt_tokens"], ids.len());
    // Special tokens (here BOS) are kept in the text, as `tokenizers` decodes.
    let (status, detok) = post_json(&cluster.url("/detokenize"), &json!({"tokens": ids}));
    assert!(status == 200 && detok["prompt"].as_str().unwrap().ends_with(prompt), "{detok}");
    let (_, plain) = post_json(&cluster.url("/tokenize"), &json!({"prompt": prompt, "add_special_tokens": false}));
    assert_eq!(plain["count"], ids.len() - 1);
    let (_, detok) = post_json(&cluster.url("/detokenize"), &json!({"tokens": plain["tokens"]}));
    assert_eq!(detok["prompt"], prompt);

    let messages = json!([{"role": "user", "content": "Hello!"}]);
    let (status, tok) = post_json(&cluster.url("/tokenize"), &json!({"messages": messages}));
    assert_eq!(status, 200, "{tok}");
    let (_, chat) = post_json(
        &cluster.url("/v1/chat/completions"),
        &json!({"messages": messages, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(chat["usage"]["prompt_tokens"], tok["count"]);
    let count = |body: Value| post_json(&cluster.url("/tokenize"), &body).1["count"].as_u64().unwrap();
    let with_prompt = tok["count"].as_u64().unwrap();
    assert!(count(json!({"messages": messages, "add_generation_prompt": false})) < with_prompt);
    // This tokenizer's post-processor prepends BOS, as for plain prompts above.
    assert_eq!(count(json!({"messages": messages, "add_special_tokens": true})), with_prompt + 1);

    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": "a", "messages": messages}), "prompt"),
        ("/tokenize", json!({"messages": []}), "messages"),
        ("/detokenize", json!({"tokens": [1, 99_999_999]}), "tokens"),
    ] {
        let (status, err) = post_json(&cluster.url(path), &body);
        assert_eq!((status, err["error"]["param"].as_str()), (400, Some(param)), "{path} {body}: {err}");
    }
}

/// Legacy completions' `text_offset` counts characters from the start of
/// the choice's text, across streamed chunks too, and after an echoed prompt.
#[test]
fn completion_text_offsets_follow_the_text() {
    let cluster = Coordinator::start("stories260K", 1, &[]);
    let prompt = "Once upon a time";
    let mut body = greedy(prompt, 6);
    body["logprobs"] = json!(1);
    let (status, plain) = post_json(&cluster.url("/v1/completions"), &body);
    assert_eq!(status, 200, "{plain}");
    let offsets = |lp: &Value| -> Vec<u64> {
        lp["text_offset"].as_array().unwrap().iter().map(|o| o.as_u64().unwrap()).collect()
    };
    let plain_offsets = offsets(&plain["choices"][0]["logprobs"]);
    assert_eq!((plain_offsets.len(), plain_offsets[0]), (6, 0));
    assert!(plain_offsets.windows(2).all(|w| w[0] <= w[1]), "{plain_offsets:?}");

    let streamed_offsets = |body: &Value| -> Vec<u64> {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let (events, _) = post_sse(&cluster.url("/v1/completions"), &body);
        events
            .iter()
            .filter_map(|e| e["choices"].get(0)?.get("logprobs").filter(|l| !l.is_null()))
            .flat_map(offsets)
            .collect()
    };
    assert_eq!(streamed_offsets(&body), plain_offsets);

    // Echoed: the prompt's 5 tokens first, then the completion's, which
    // start where the echoed text ends.
    body["echo"] = json!(true);
    let (status, echoed) = post_json(&cluster.url("/v1/completions"), &body);
    assert!(status == 200 && echoed["choices"][0]["text"].as_str().unwrap().starts_with(prompt), "{echoed}");
    let echoed_offsets = offsets(&echoed["choices"][0]["logprobs"]);
    let tail: Vec<u64> = plain_offsets.iter().map(|o| o + prompt.len() as u64).collect();
    assert_eq!((echoed_offsets.len(), &echoed_offsets[5..]), (11, tail.as_slice()));
    assert_eq!(streamed_offsets(&body), echoed_offsets);
}

/// Scoring a text as lm-eval and OpenAI's legacy API do: `echo` with
/// `logprobs` (and `max_tokens: 0` for the prompt alone) returns each prompt
/// token's logprob given the tokens before it. Scoring a prompt plus its
/// greedy continuation gives, at the continuation, what decoding reported;
/// streamed or not; `/generate` gives the same under `prompt_logprobs`.
#[test]
fn echo_with_logprobs_scores_the_prompt() {
    let cluster = Coordinator::start("stories260K", 1, &[]);
    let case = &cases()[3];
    let prompt: Vec<u64> = case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let body =
        json!({"prompt_token_ids": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": 1});
    let (status, generated) = post_json(&cluster.url("/generate"), &body);
    assert_eq!(status, 200, "{generated}");
    let ids: Vec<u64> = generated["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let decoded: Vec<f64> =
        generated["logprobs"].as_array().unwrap().iter().map(|l| l["logprob"].as_f64().unwrap()).collect();
    let text: Vec<u64> = prompt.iter().chain(&ids).copied().collect();

    let score = json!({"prompt": text, "max_tokens": 0, "echo": true, "logprobs": 1, "temperature": 0});
    let (status, scored) = post_json(&cluster.url("/v1/completions"), &score);
    assert_eq!(status, 200, "{scored}");
    let choice = &scored["choices"][0];
    let token_logprobs = choice["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(token_logprobs.len(), text.len());
    assert!(token_logprobs[0].is_null() && choice["logprobs"]["top_logprobs"][0].is_null(), "{choice}");
    let tail: Vec<f64> = token_logprobs[prompt.len()..].iter().map(|v| v.as_f64().unwrap()).collect();
    for (got, want) in tail.iter().zip(&decoded) {
        assert!((got - want).abs() < 1e-4, "scored {tail:?} vs decoded {decoded:?}");
    }
    // lm-eval's "is greedy" test: each continuation token is its position's top-1.
    for (i, top) in choice["logprobs"]["top_logprobs"].as_array().unwrap()[prompt.len()..].iter().enumerate() {
        let best = top.as_object().unwrap().values().map(|v| v.as_f64().unwrap()).fold(f64::MIN, f64::max);
        assert_eq!(best, tail[i], "{top}");
    }
    assert_eq!(
        (choice["finish_reason"].as_str(), scored["usage"]["completion_tokens"].as_u64()),
        (Some("length"), Some(0))
    );
    let echoed_text = choice["text"].as_str().unwrap().to_string();
    assert!(echoed_text.starts_with(case["prompt_text"].as_str().unwrap()), "{echoed_text:?}");

    // Streamed: one chunk with the echoed prompt and the same numbers, and no token after it.
    let mut streamed = score.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (events, done) = post_sse(&cluster.url("/v1/completions"), &streamed);
    assert!(done);
    let texts: String = events.iter().filter_map(|e| e["choices"].get(0)?["text"].as_str()).collect();
    assert_eq!(texts, echoed_text);
    let streamed_logprobs: Vec<&Value> =
        events.iter().filter_map(|e| e["choices"].get(0)?.get("logprobs").filter(|l| !l.is_null())).collect();
    assert_eq!(streamed_logprobs.len(), 1);
    assert_eq!(&streamed_logprobs[0]["token_logprobs"], &choice["logprobs"]["token_logprobs"]);
    assert_eq!(events.last().unwrap()["usage"]["completion_tokens"].as_u64(), Some(0));

    // `/generate`'s prompt_logprobs: the same numbers, each naming its token.
    let body = json!({"prompt_token_ids": text, "max_tokens": 1, "prompt_logprobs": 0});
    let (status, generated) = post_json(&cluster.url("/generate"), &body);
    assert_eq!(status, 200, "{generated}");
    let entries = generated["prompt_logprobs"].as_array().unwrap();
    assert_eq!(entries.len(), text.len());
    assert!(entries[0].is_null());
    for (i, e) in entries.iter().enumerate().skip(1) {
        assert_eq!(e["token_id"].as_u64(), Some(text[i]));
        assert_eq!(e["logprob"], token_logprobs[i]);
    }
    let (status, err) = post_json(&cluster.url("/generate"), &json!({"prompt": "Once", "prompt_logprobs": 21}));
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("prompt_logprobs")), "{err}");
}
