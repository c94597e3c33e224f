//! Speculative decoding through a real cluster (issue 33): a worker started
//! with `--speculative-method ngram`, or `draft` with a draft model, streams
//! every stories260K golden case's exact tokens, several per event where
//! proposals were accepted, with one logprob per token; requests turn
//! speculation on or off for themselves, on `/generate` and the OpenAI
//! endpoints; bad options get a 400 naming the field; the worker's
//! Prometheus endpoint counts drafts under vLLM's names.

use serde_json::{Value, json};
use tinyvllm_tests::{Coordinator, golden, post_json, post_sse, truncated_model};

/// The first worker's metrics, as text.
fn worker_metrics(cluster: &Coordinator) -> String {
    let targets: Value =
        ureq::get(&cluster.url("/v1/prometheus/targets")).call().expect("targets").into_json().unwrap();
    let worker = targets[0]["targets"][0].as_str().expect("a worker target").to_string();
    ureq::get(&format!("http://{worker}/metrics")).call().expect("scrape").into_string().unwrap()
}

/// The value of an unlabelled (but for model and worker) counter.
fn counter(metrics: &str, name: &str) -> f64 {
    let line = metrics.lines().find(|l| l.starts_with(&format!("{name}{{"))).unwrap_or_else(|| panic!("{name}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// Streams one greedy case; returns its tokens, the number of events
/// carrying more than one token, and the number of logprob entries.
fn stream_case(cluster: &Coordinator, prompt: &Value, max_tokens: usize, extra: Value) -> (Vec<u32>, usize, usize) {
    let mut body = json!({"prompt_token_ids": prompt, "max_tokens": max_tokens, "temperature": 0,
                          "ignore_eos": true, "stream": true, "logprobs": 1});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (events, done) = post_sse(&cluster.url("/generate"), &body);
    assert!(done, "{events:?}");
    let mut tokens = Vec::new();
    let (mut multi, mut logprobs) = (0, 0);
    for e in &events {
        let ids: Vec<u32> = e["token_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        multi += usize::from(ids.len() > 1);
        logprobs += e["logprobs"].as_array().map_or(0, Vec::len);
        tokens.extend(ids);
    }
    (tokens, multi, logprobs)
}

/// Streams every stories260K golden case with the worker's own setting,
/// then again with `also` in the request: both must give the golden tokens,
/// the first with one logprob per token. Returns how many events of each
/// pass carried more than one token.
fn stream_golden_cases(cluster: &Coordinator, also: Value) -> (usize, usize) {
    let golden = golden("stories260K.json");
    let (mut multi_token_events, mut also_multi) = (0, 0);
    for case in golden["cases"].as_array().unwrap() {
        let want: Vec<u32> =
            case["generated_ids"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let (got, multi, logprobs) = stream_case(cluster, &case["prompt_ids"], want.len(), json!({}));
        assert_eq!(got, want, "case {}", case["id"]);
        assert_eq!(logprobs, want.len(), "one logprob per token, case {}", case["id"]);
        multi_token_events += multi;
        let (again, multi, _) = stream_case(cluster, &case["prompt_ids"], want.len(), also.clone());
        assert_eq!(again, want, "case {} with {also}", case["id"]);
        also_multi += multi;
    }
    (multi_token_events, also_multi)
}

#[test]
fn a_speculating_worker_streams_the_golden_tokens() {
    let cluster = Coordinator::start("stories260K", 1, &["--worker-arg=--speculative-method=ngram"]);
    // The same cases with speculation off for the request alone.
    let (multi_token_events, multi_when_off) = stream_golden_cases(&cluster, json!({"speculative": {"method": "off"}}));
    assert_eq!(multi_when_off, 0, "a request that turned speculation off got several tokens in one event");
    assert!(multi_token_events > 0, "no step accepted a proposal");
    let metrics = worker_metrics(&cluster);
    let drafts = counter(&metrics, "vllm:spec_decode_num_drafts_total");
    let proposed = counter(&metrics, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = counter(&metrics, "vllm:spec_decode_num_accepted_tokens_total");
    assert!(drafts > 0.0 && proposed >= drafts && accepted > 0.0 && accepted <= proposed, "{metrics}");
    let per_pos: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("vllm:spec_decode_num_accepted_tokens_per_pos_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(per_pos, accepted, "per-position counts add up to the accepted tokens");
}

#[test]
fn a_worker_with_a_draft_model_streams_the_golden_tokens() {
    // The draft: stories260K's own first 2 of 5 layers.
    let draft = truncated_model("stories260K", 2);
    let draft_arg = format!("--worker-arg=--draft-model={}", draft.0.display());
    let cluster = Coordinator::start("stories260K", 1, &["--worker-arg=--speculative-method=draft", &draft_arg]);
    // The same worker proposes by n-gram for a request that asks.
    let ngram = json!({"speculative": {"method": "ngram", "num_speculative_tokens": 2}});
    let (multi_token_events, _) = stream_golden_cases(&cluster, ngram);
    assert!(multi_token_events > 0, "no step accepted a proposal");
    let metrics = worker_metrics(&cluster);
    let proposed = counter(&metrics, "vllm:spec_decode_num_draft_tokens_total");
    let accepted = counter(&metrics, "vllm:spec_decode_num_accepted_tokens_total");
    assert!(accepted > 0.0 && accepted < proposed, "{metrics}");
    // The OpenAI endpoints take the same per-request option (chat
    // completions shares the field; stories260K has no chat template):
    // seeded sampling gives the same text with the draft, n-gram or neither.
    let prompt = "Once upon a time, there was a little girl named Lily.";
    let mut texts = Vec::new();
    for spec in [json!({"method": "off"}), json!({"method": "draft", "num_speculative_tokens": 3}), Value::Null] {
        let body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0.8, "seed": 7, "speculative": spec});
        let (status, reply) = post_json(&cluster.url("/v1/completions"), &body);
        assert_eq!(status, 200, "{reply}");
        texts.push(reply["choices"][0]["text"].as_str().unwrap().to_string());
    }
    assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
}

#[test]
fn requests_choose_speculation_and_bad_options_are_refused() {
    let cluster = Coordinator::start("stories260K", 1, &[]);
    let prompt = "Once upon a time, there was a little girl. Once upon a time, there was a little";
    let body = |spec: Value| json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "speculative": spec});
    let drafts = || counter(&worker_metrics(&cluster), "vllm:spec_decode_num_drafts_total");
    let (status, plain) = post_json(&cluster.url("/generate"), &body(Value::Null));
    assert_eq!(status, 200, "{plain}");
    assert_eq!(drafts(), 0.0, "the worker does not speculate by default");
    let ngram = json!({"method": "ngram", "num_speculative_tokens": 3});
    let (status, fast) = post_json(&cluster.url("/generate"), &body(ngram));
    assert_eq!(status, 200, "{fast}");
    assert_eq!(fast["token_ids"], plain["token_ids"]);
    // The worker updates its counters just after the step that sent the last token.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while drafts() == 0.0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(drafts() > 0.0, "the request asked for n-gram proposals");
    // A stop string inside a step's accepted run ends the output at its
    // token, as in plain decoding: the tokens after it are not returned.
    let text = plain["text"].as_str().unwrap();
    let stop: String = text.chars().skip(text.chars().count() / 2).take(6).collect();
    let with_stop = |spec: Value| {
        let mut b = body(spec);
        b["stop"] = json!([stop]);
        post_json(&cluster.url("/generate"), &b).1
    };
    let (a, b) = (with_stop(json!({"method": "off"})), with_stop(json!({"method": "ngram"})));
    assert_eq!(a["finish_reason"], "stop", "{a}");
    let completion = |v: &Value| v["usage"]["completion_tokens"].clone();
    assert_eq!((&a["text"], &a["token_ids"], completion(&a)), (&b["text"], &b["token_ids"], completion(&b)));
    // This worker has no draft model: a clear 400, from the worker.
    let (status, err) = post_json(&cluster.url("/generate"), &body(json!({"method": "draft"})));
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("no draft model"), "{err}");
    let (status, err) = post_json(
        &cluster.url("/v1/completions"),
        &json!({"prompt": prompt, "max_tokens": 4, "speculative": {"method": "ngram", "num_speculative_tokens": 0}}),
    );
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("speculative.num_speculative_tokens")), "{err}");
    for (spec, param) in [
        (json!({"method": "eagle"}), "speculative.method"),
        (json!({"method": "ngram", "num_speculative_tokens": 0}), "speculative.num_speculative_tokens"),
        (json!({"method": "ngram", "num_speculative_tokens": 17}), "speculative.num_speculative_tokens"),
        (json!({"method": "off", "num_speculative_tokens": 2}), "speculative.num_speculative_tokens"),
    ] {
        let (status, err) = post_json(&cluster.url("/generate"), &body(spec.clone()));
        assert_eq!((status, err["error"]["param"].as_str()), (400, Some(param)), "{spec}: {err}");
    }
    let (status, err) = post_json(&cluster.url("/generate"), &body(json!("ngram")));
    assert_eq!((status, err["error"]["param"].as_str()), (400, Some("speculative")), "{err}");
}

/// The speculation counters of a worker (a pipeline's first stage):
/// (proposals made, tokens proposed, tokens accepted).
fn spec_counters(cluster: &Coordinator) -> (f64, f64, f64) {
    let metrics = worker_metrics(cluster);
    let value = |name| counter(&metrics, name);
    (
        value("vllm:spec_decode_num_drafts_total"),
        value("vllm:spec_decode_num_draft_tokens_total"),
        value("vllm:spec_decode_num_accepted_tokens_total"),
    )
}

/// Speculating pipelines: the first stage proposes, the last verifies, and
/// the accepted runs come back along the chain.
const PIPELINE_SPECULATES: [&str; 2] =
    ["--worker-arg=--speculative-method=ngram", "--worker-arg=--speculative-max-batch-tokens=1000"];

/// Every stories260K golden case at once (on a pipeline: micro-batches in
/// flight, each verifying its proposals), greedy with logprobs.
fn golden_cases_at_once(cluster: &Coordinator, what: &str) {
    let golden = golden("stories260K.json");
    let cases = golden["cases"].as_array().unwrap();
    let handles: Vec<_> = cases
        .iter()
        .map(|case| {
            let body = json!({"prompt_token_ids": case["prompt_ids"], "max_tokens": 48, "temperature": 0,
                              "ignore_eos": true, "logprobs": 1});
            let url = cluster.url("/generate");
            std::thread::spawn(move || post_json(&url, &body))
        })
        .collect();
    for (case, h) in cases.iter().zip(handles) {
        let (status, out) = h.join().unwrap();
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["token_ids"], case["generated_ids"], "{what}, case {}", case["id"]);
        assert_eq!(out["logprobs"].as_array().map(Vec::len), Some(48), "one logprob per token");
    }
}

#[test]
fn speculating_pipelines_of_2_and_3_stages_stream_the_golden_tokens() {
    for stages in [2, 3] {
        let cluster = Coordinator::start_pipelines("stories260K", 1, stages, &PIPELINE_SPECULATES);
        // One at a time, streamed (several tokens an event), and with speculation off.
        let (multi_token_events, multi_when_off) =
            stream_golden_cases(&cluster, json!({"speculative": {"method": "off"}}));
        assert!(multi_token_events > 0, "{stages} stages: no step accepted a proposal");
        assert_eq!(multi_when_off, 0, "{stages} stages: a request that turned speculation off");
        golden_cases_at_once(&cluster, &format!("{stages} stages"));
        let (drafts, proposed, accepted) = spec_counters(&cluster);
        assert!(drafts > 0.0 && accepted > 0.0 && accepted < proposed, "{drafts} {proposed} {accepted}");
        // This pipeline has no draft model: a clear 400.
        let body = json!({"prompt": "Once upon a time", "max_tokens": 4, "speculative": {"method": "draft"}});
        let (status, err) = post_json(&cluster.url("/generate"), &body);
        assert_eq!(status, 400, "{err}");
        assert!(err["error"]["message"].as_str().unwrap().contains("no draft model"), "{err}");
    }
}

#[test]
fn a_pipeline_with_a_draft_model_streams_the_golden_tokens() {
    // The draft (stories260K's own first 2 of 5 layers) runs whole on the
    // first stage; the last stage verifies its proposals.
    let draft = truncated_model("stories260K", 2);
    let draft_arg = format!("--worker-arg=--draft-model={}", draft.0.display());
    let extra = ["--worker-arg=--speculative-method=draft", &draft_arg, PIPELINE_SPECULATES[1]];
    let cluster = Coordinator::start_pipelines("stories260K", 1, 2, &extra);
    let ngram = json!({"speculative": {"method": "ngram", "num_speculative_tokens": 2}});
    let (multi_token_events, _) = stream_golden_cases(&cluster, ngram);
    assert!(multi_token_events > 0, "no step accepted a proposal");
    golden_cases_at_once(&cluster, "draft on 2 stages");
    let (drafts, proposed, accepted) = spec_counters(&cluster);
    assert!(drafts > 0.0 && accepted > 0.0 && accepted < proposed, "{drafts} {proposed} {accepted}");
    // Seeded sampling: the same text with the draft, n-gram or neither.
    let prompt = "Once upon a time, there was a little girl named Lily.";
    let texts: Vec<Value> = [json!({"method": "off"}), json!({"method": "ngram"}), Value::Null]
        .into_iter()
        .map(|spec| {
            let body = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0.8, "seed": 7, "speculative": spec});
            let (status, reply) = post_json(&cluster.url("/v1/completions"), &body);
            assert_eq!(status, 200, "{reply}");
            reply["choices"][0]["text"].clone()
        })
        .collect();
    assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
}

#[test]
fn seeded_sampling_on_a_speculating_pipeline_is_a_single_workers() {
    // Repeated text, so proposals are made and many accepted; penalties,
    // min_tokens and logprobs ride along; all requests at once, so steps
    // in flight hold several of them.
    let story = "Once upon a time, there was a little girl. She liked to play.";
    let bodies: Vec<Value> = (0..4)
        .map(|i| {
            let mut body = json!({"prompt": format!("{story} {story} {i} {story}"), "max_tokens": 32,
                                  "temperature": 0.8, "seed": 11 + i, "logprobs": 2, "min_tokens": 8});
            if i % 2 == 1 {
                body["repetition_penalty"] = json!(1.2);
                body["frequency_penalty"] = json!(0.3);
            }
            body
        })
        .collect();
    let answers = |cluster: &Coordinator, spec: Value| -> Vec<Value> {
        let handles: Vec<_> = bodies
            .iter()
            .map(|body| {
                let (url, mut body) = (cluster.url("/generate"), body.clone());
                body["speculative"] = spec.clone();
                std::thread::spawn(move || post_json(&url, &body))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                let (status, out) = h.join().unwrap();
                assert_eq!(status, 200, "{out}");
                out
            })
            .collect()
    };
    // Tokens and text exactly; logprobs to rounding (batches of other
    // shapes take other paths through the matrix kernels).
    let same = |a: &[Value], b: &[Value], what: &str| {
        for (a, b) in a.iter().zip(b) {
            assert_eq!((&a["token_ids"], &a["text"]), (&b["token_ids"], &b["text"]), "{what}");
            let logprobs = |v: &Value| -> Vec<(u64, f64)> {
                let entries = v["logprobs"].as_array().expect("logprobs");
                let top = entries.iter().flat_map(|e| e["top_logprobs"].as_array().expect("top").iter().chain([e]));
                top.map(|t| (t["token_id"].as_u64().unwrap(), t["logprob"].as_f64().unwrap())).collect()
            };
            let (la, lb) = (logprobs(a), logprobs(b));
            assert_eq!(la.len(), lb.len(), "{what}");
            for ((ta, xa), (tb, xb)) in la.iter().zip(&lb) {
                assert!(ta == tb && (xa - xb).abs() < 1e-4, "{what}: {ta} {xa} against {tb} {xb}");
            }
        }
    };
    let extra = [PIPELINE_SPECULATES[0], PIPELINE_SPECULATES[1], "--worker-arg=--prompt-lookup-min=1"];
    let pipeline = Coordinator::start_pipelines("stories260K", 1, 2, &extra);
    let (speculated, plain) = (answers(&pipeline, Value::Null), answers(&pipeline, json!({"method": "off"})));
    let (_, proposed, accepted) = spec_counters(&pipeline);
    assert!(accepted > 0.0 && accepted < proposed, "{proposed} {accepted}");
    drop(pipeline);
    let single = Coordinator::start("stories260K", 1, &extra);
    same(&speculated, &answers(&single, Value::Null), "a speculating single worker");
    same(&plain, &speculated, "the pipeline without speculation");
}
