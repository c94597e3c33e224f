//! Structured outputs in the engine, on tiny-qwen3 (random weights, Llama
//! 2's 32,000-token vocabulary): constrained requests batched with free
//! ones produce text that matches their constraint, end with EOS, and come
//! out the same when preempted, resumed on another engine after k tokens
//! (a re-dispatch), or sampled on the device.

use std::collections::HashMap;
use std::path::PathBuf;

use common::{RequestId, SamplingParams, StructuredOutput};
use engine_core::FinishReason;
use worker::models::{ModelFiles, ModelSource, Need};
use worker::{Engine, EngineConfig};

fn model() -> ModelFiles {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models/tiny-qwen3"));
    ModelFiles::resolve(&ModelSource::Dir(dir), Need::Weights).unwrap()
}

fn engine(config: EngineConfig) -> Engine {
    Engine::new(&model(), config).unwrap()
}

fn decode(ids: &[u32]) -> String {
    let files = model();
    let tokenizer = tokenizers::Tokenizer::from_file(files.tokenizer_json.unwrap()).unwrap();
    tokenizer.decode(ids, true).unwrap()
}

const SCHEMA: &str = r#"{"type":"object","properties":{"n":{"type":"integer","minimum":0,"maximum":99},
    "w":{"enum":["up","down"]},"s":{"type":"string","maxLength":6}},"required":["n","w","s"],"additionalProperties":false}"#;

/// Constrained requests at several temperatures, and one free request.
fn requests() -> Vec<(Vec<u32>, SamplingParams)> {
    let constraints = [
        StructuredOutput::JsonSchema(SCHEMA.into()),
        StructuredOutput::Regex("[a-c]{2,5}-[0-9]{2}".into()),
        StructuredOutput::Choice(vec!["alpha".into(), "beta gamma".into()]),
        StructuredOutput::JsonObject,
        StructuredOutput::Lark(r#"start: "x=" %json{"type": "boolean"}"#.into()),
    ];
    let mut out = Vec::new();
    for (i, c) in constraints.into_iter().enumerate() {
        for (j, temperature) in [0.0, 1.0, 1.8].into_iter().enumerate() {
            let prompt: Vec<u32> = (0..20 + 3 * i as u32).map(|t| 100 + (t * 37 + j as u32) % 3000).collect();
            let params = SamplingParams {
                temperature,
                seed: Some((i * 10 + j) as u64),
                structured_output: Some(c.clone()),
                ..SamplingParams::greedy(120)
            };
            out.push((prompt, params));
        }
    }
    out.push(((0..30).collect(), SamplingParams { ignore_eos: true, ..SamplingParams::greedy(40) }));
    out
}

fn run(engine: &mut Engine, requests: &[(Vec<u32>, SamplingParams)]) -> HashMap<u64, (Vec<u32>, Option<FinishReason>)> {
    for (i, (prompt, params)) in requests.iter().enumerate() {
        engine.add_request(RequestId(i as u64), prompt.clone(), params.clone(), 0).unwrap();
    }
    drain(engine)
}

fn drain(engine: &mut Engine) -> HashMap<u64, (Vec<u32>, Option<FinishReason>)> {
    let mut out: HashMap<u64, (Vec<u32>, Option<FinishReason>)> = HashMap::new();
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let entry = out.entry(o.id.0).or_default();
            entry.0.extend(o.new_token_ids);
            entry.1 = o.finish_reason;
        }
    }
    out
}

/// The text of a finished request, checked against its constraint.
fn check(constraint: &StructuredOutput, tokens: &[u32], finish: Option<FinishReason>) {
    let text = decode(tokens);
    if finish == Some(FinishReason::Length) {
        return; // a prefix (json_object may run long on random weights)
    }
    assert_eq!(finish, Some(FinishReason::Stop), "{constraint:?}: {text:?}");
    assert_eq!(tokens.last(), Some(&2), "ends with EOS: {text:?}");
    match constraint {
        StructuredOutput::JsonSchema(_) => {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
            assert!(v["n"].as_u64().is_some_and(|n| n <= 99), "{text}");
            assert!(["up", "down"].contains(&v["w"].as_str().unwrap_or("")), "{text}");
            assert!(v["s"].as_str().is_some_and(|s| s.chars().count() <= 6), "{text}");
            assert_eq!(v.as_object().map(|o| o.len()), Some(3), "{text}");
        }
        StructuredOutput::Regex(_) => {
            let (letters, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
            assert!(
                (2..=5).contains(&letters.len()) && letters.bytes().all(|b| (b'a'..=b'c').contains(&b)),
                "{text:?}"
            );
            assert!(digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
        }
        StructuredOutput::Choice(choices) => assert!(choices.contains(&text), "{text:?}"),
        StructuredOutput::JsonObject => assert!(serde_json::from_str::<serde_json::Value>(&text).unwrap().is_object()),
        StructuredOutput::Lark(_) => assert!(text == "x=true" || text == "x=false", "{text:?}"),
        StructuredOutput::Then { .. } => unreachable!("not among this test's constraints"),
    }
}

#[test]
fn constrained_outputs_match_and_survive_preemption_redispatch_and_device_sampling() {
    let requests = requests();
    let reference = run(&mut engine(EngineConfig { num_blocks: Some(512), ..EngineConfig::default() }), &requests);
    let mut stopped = 0;
    for (i, (_, params)) in requests.iter().enumerate() {
        let (tokens, finish) = &reference[&(i as u64)];
        if let Some(c) = &params.structured_output {
            check(c, tokens, *finish);
            stopped += usize::from(*finish == Some(FinishReason::Stop));
        }
    }
    assert!(stopped >= 12, "only {stopped} of 15 constrained requests ended with their grammar");

    // Preemption by recompute keeps the output, and the matcher with it.
    let mut small =
        engine(EngineConfig { num_blocks: Some(20), max_num_batched_tokens: 64, ..EngineConfig::default() });
    assert_eq!(run(&mut small, &requests), reference);
    assert!(small.stats().num_preemptions > 0, "no preemption happened");

    // A re-dispatch: a fresh engine resumes each request after 3 tokens.
    let mut resumed = engine(EngineConfig { num_blocks: Some(512), ..EngineConfig::default() });
    for (i, (prompt, params)) in requests.iter().enumerate() {
        let (tokens, _) = &reference[&(i as u64)];
        let done = &tokens[..3.min(tokens.len() - 1)];
        resumed.resume_request(RequestId(i as u64), prompt.clone(), done, params.clone(), 0).unwrap();
    }
    for (id, (tokens, finish)) in drain(&mut resumed) {
        let (want, want_finish) = &reference[&id];
        assert_eq!((&want[3.min(want.len() - 1)..], want_finish), (&tokens[..], &finish), "request {id}");
    }

    // The device sampler (run on the CPU here) obeys the masks too.
    let config = EngineConfig { num_blocks: Some(512), device_sampling: Some(true), ..EngineConfig::default() };
    let on_device = run(&mut engine(config), &requests);
    for (i, (_, params)) in requests.iter().enumerate() {
        if let Some(c) = &params.structured_output {
            let (tokens, finish) = &on_device[&(i as u64)];
            check(c, tokens, *finish);
        }
    }
}

#[test]
fn bad_constraints_and_models_without_a_vocabulary_are_refused() {
    let mut e = engine(EngineConfig { num_blocks: Some(64), ..EngineConfig::default() });
    let bad =
        SamplingParams { structured_output: Some(StructuredOutput::Regex("(".into())), ..SamplingParams::greedy(4) };
    assert!(e.add_request(RequestId(1), vec![5, 6], bad, 0).is_err());
    // Output that leaves the grammar cannot be resumed.
    let choice = StructuredOutput::Choice(vec!["alpha".into()]);
    let params = SamplingParams { structured_output: Some(choice), ..SamplingParams::greedy(8) };
    assert!(e.resume_request(RequestId(2), vec![5, 6], &[2], params, 0).is_err());
    assert!(!e.has_unfinished());

    let mut files = model();
    files.tokenizer_json = None;
    let mut e = Engine::new(&files, EngineConfig { num_blocks: Some(64), ..EngineConfig::default() }).unwrap();
    let json = SamplingParams { structured_output: Some(StructuredOutput::JsonObject), ..SamplingParams::greedy(4) };
    let err = e.add_request(RequestId(3), vec![5, 6], json, 0).unwrap_err();
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}
