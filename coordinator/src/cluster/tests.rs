//! The cluster with workers on channels instead of QUIC: re-dispatch and
//! routing of prompt-scoring requests.

use common::SamplingParams;
use common::protocol::{CoordinatorMessage, Handshake, PROTOCOL_VERSION, WorkerMessage};
use tokio::sync::mpsc;

use super::*;

fn lp(logprob: f32) -> WireLogprobs {
    WireLogprobs { logprob, top: Vec::new() }
}

fn delta(id: RequestId, prompt_logprobs: Vec<WireLogprobs>, tokens: Vec<u32>) -> WorkerMessage {
    WorkerMessage::TokenDelta {
        request_id: id,
        prompt_logprobs,
        logprobs: Vec::new(),
        new_token_ids: tokens,
        finish_reason: None,
        num_prompt_tokens: 5,
        num_cached_tokens: 0,
    }
}

/// Workers on channels instead of QUIC: what the cluster sends each one.
fn cluster_with_workers(n: usize, policy: Policy) -> (Cluster, Vec<mpsc::UnboundedReceiver<CoordinatorMessage>>) {
    let model = ModelIdentity { name: "m".into(), config_hash: 1 };
    let cluster = Cluster::new(String::new(), model.clone(), 16, policy, 16);
    let mut inboxes = Vec::new();
    for i in 0..n {
        let hello = Handshake {
            protocol_version: PROTOCOL_VERSION,
            worker_name: format!("w{i}"),
            model: model.clone(),
            block_size: 16,
            kv_capacity_blocks: 100,
            max_model_len: 1024,
            metrics_address: None,
            device: "cpu".into(),
            auth_tag: Vec::new(),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        cluster.register_worker(&hello, "127.0.0.1:1".parse().expect("address"), tx);
        inboxes.push(rx);
    }
    (cluster, inboxes)
}

/// The `Generate` a worker received last.
fn generate_sent(inbox: &mut mpsc::UnboundedReceiver<CoordinatorMessage>) -> Option<(Vec<u32>, SamplingParams)> {
    let mut last = None;
    while let Ok(message) = inbox.try_recv() {
        if let CoordinatorMessage::Generate { prompt_token_ids, params, .. } = message {
            last = Some((prompt_token_ids, params));
        }
    }
    last
}

fn prompt_logprobs_received(events: &mut mpsc::UnboundedReceiver<RequestEvent>) -> Vec<f32> {
    let mut got = Vec::new();
    while let Ok(event) = events.try_recv() {
        if let RequestEvent::PromptLogprobs(lps) = event {
            got.extend(lps.iter().map(|l| l.logprob));
        }
    }
    got
}

/// A worker lost halfway through a prompt's logprobs: the next one
/// scores the prompt again and the client gets each position once; lost
/// after all of them came, the next one is not asked for them.
#[test]
fn redispatch_reports_each_prompt_logprob_once() {
    let (cluster, mut inboxes) = cluster_with_workers(3, Policy::RoundRobin);
    let scoring = SamplingParams { prompt_logprobs: Some(0), ..SamplingParams::greedy(4) };
    let (id, first, mut events) = cluster.submit(vec![1, 2, 3, 4, 5], scoring.clone()).expect("submitted");
    cluster.on_worker_message(first, delta(id, vec![lp(-1.0), lp(-2.0)], vec![]));
    cluster.remove_worker(first, "test");
    let second = cluster.request_worker(id).expect("re-dispatched");
    let (prompt, params) = generate_sent(&mut inboxes[second.0 as usize]).expect("sent to the next worker");
    assert_eq!((prompt, params.prompt_logprobs), (vec![1, 2, 3, 4, 5], Some(0)));
    // The next worker sends positions 1.. again, in two chunks; then the first token.
    cluster.on_worker_message(second, delta(id, vec![lp(-1.5), lp(-2.5), lp(-3.0)], vec![]));
    cluster.on_worker_message(second, delta(id, vec![lp(-4.0)], vec![9]));
    assert_eq!(prompt_logprobs_received(&mut events), [-1.0, -2.0, -3.0, -4.0]);

    let (id, first, mut events) = cluster.submit(vec![1, 2, 3], scoring).expect("submitted");
    cluster.on_worker_message(first, delta(id, vec![lp(-1.0), lp(-2.0)], vec![7]));
    cluster.remove_worker(first, "test");
    let next = cluster.request_worker(id).expect("re-dispatched");
    let (prompt, params) = generate_sent(&mut inboxes[next.0 as usize]).expect("sent to the next worker");
    assert_eq!((prompt, params.prompt_logprobs), (vec![1, 2, 3, 7], None));
    assert_eq!(prompt_logprobs_received(&mut events), [-1.0, -2.0]);
}

/// A request scoring its prompt reads no cache on its worker, so the
/// router expects no hit for it and goes by load alone.
#[test]
fn scoring_requests_are_routed_without_expecting_cache_hits() {
    let (cluster, _inboxes) = cluster_with_workers(2, Policy::PrefixAware);
    let prompt: Vec<u32> = (0..40).collect();
    let chain = common::hash_prompt_blocks(&prompt, 16);
    let hashes = chain.iter().map(|&h| (h, None)).collect();
    cluster.on_worker_message(WorkerId(1), WorkerMessage::KvSnapshot { last_event_id: None, hashes });
    let predicted = || cluster.metrics.predicted_cached_tokens.with_label_values(&["w1"]).get();
    let (_, worker, _) = cluster.submit(prompt.clone(), SamplingParams::greedy(4)).expect("submitted");
    assert_eq!((worker, predicted()), (WorkerId(1), 32), "a plain request goes where its 2 blocks are");
    let scoring = SamplingParams { prompt_logprobs: Some(0), ..SamplingParams::greedy(4) };
    let (_, worker, _) = cluster.submit(prompt, scoring).expect("submitted");
    assert_eq!((worker, predicted()), (WorkerId(0), 32), "the scoring one goes to the idle worker");
}
