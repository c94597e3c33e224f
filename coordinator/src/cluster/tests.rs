//! The cluster with workers on channels instead of QUIC: re-dispatch and
//! routing of prompt-scoring requests.

use common::SamplingParams;
use common::protocol::{CoordinatorMessage, Handshake, PROTOCOL_VERSION, WorkerMessage, WorkerStats};
use tokio::sync::mpsc;

use super::*;

fn lp(logprob: f32) -> TokenLogprobs {
    TokenLogprobs { logprob, top: Vec::new() }
}

fn delta(id: RequestId, prompt_logprobs: Vec<TokenLogprobs>, tokens: Vec<u32>) -> WorkerMessage {
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
    cluster_with_workers_tiered(n, policy, false)
}

/// [`cluster_with_workers`] whose workers take a peer's KV blocks (`kv_tier`).
fn cluster_with_workers_tiered(
    n: usize,
    policy: Policy,
    kv_tier: bool,
) -> (Cluster, Vec<mpsc::UnboundedReceiver<CoordinatorMessage>>) {
    let model = ModelIdentity { name: "m".into(), config_hash: 1 };
    let cluster = Cluster::new(String::new(), model.clone(), 1024, policy, 16);
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
            stages: Vec::new(),
            joined_by: common::protocol::JoinedBy::Address,
            instance_id: String::new(),
            auth_tag: Vec::new(),
            kv_identity: 7,
            kv_block_bytes: 1 << 16,
            kv_tier,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        cluster.register_worker(&hello, "127.0.0.1:1".parse().expect("address"), tx);
        inboxes.push(rx);
    }
    (cluster, inboxes)
}

/// The `Generate` a worker received last: prompt, output so far, parameters.
fn generate_sent(
    inbox: &mut mpsc::UnboundedReceiver<CoordinatorMessage>,
) -> Option<(Vec<u32>, Vec<u32>, SamplingParams)> {
    let mut last = None;
    while let Ok(message) = inbox.try_recv() {
        if let CoordinatorMessage::Generate { prompt_token_ids, output_token_ids, params, .. } = message {
            last = Some((prompt_token_ids, output_token_ids, params));
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
    let (id, first, mut events) = cluster.submit(vec![1, 2, 3, 4, 5], scoring.clone(), 0).expect("submitted");
    cluster.on_worker_message(first, delta(id, vec![lp(-1.0), lp(-2.0)], vec![]));
    cluster.remove_worker(first, "test");
    let second = cluster.request_worker(id).expect("re-dispatched");
    let (prompt, output, params) = generate_sent(&mut inboxes[second.0 as usize]).expect("sent to the next worker");
    assert_eq!((prompt, output, params.prompt_logprobs), (vec![1, 2, 3, 4, 5], vec![], Some(0)));
    // The next worker sends positions 1.. again, in two chunks; then the first token.
    cluster.on_worker_message(second, delta(id, vec![lp(-1.5), lp(-2.5), lp(-3.0)], vec![]));
    cluster.on_worker_message(second, delta(id, vec![lp(-4.0)], vec![9]));
    assert_eq!(prompt_logprobs_received(&mut events), [-1.0, -2.0, -3.0, -4.0]);

    let (id, first, mut events) = cluster.submit(vec![1, 2, 3], scoring, 0).expect("submitted");
    cluster.on_worker_message(first, delta(id, vec![lp(-1.0), lp(-2.0)], vec![7]));
    cluster.remove_worker(first, "test");
    let next = cluster.request_worker(id).expect("re-dispatched");
    let (prompt, output, params) = generate_sent(&mut inboxes[next.0 as usize]).expect("sent to the next worker");
    assert_eq!((prompt, output, params.prompt_logprobs), (vec![1, 2, 3], vec![7], None));
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
    cluster.on_worker_message(
        WorkerId(1),
        WorkerMessage::KvSnapshot { last_event_id: None, hashes, offloaded: Vec::new() },
    );
    let predicted = || cluster.metrics.predicted_cached_tokens.with_label_values(&["w1"]).get();
    let (_, worker, _) = cluster.submit(prompt.clone(), SamplingParams::greedy(4), 0).expect("submitted");
    assert_eq!((worker, predicted()), (WorkerId(1), 32), "a plain request goes where its 2 blocks are");
    let scoring = SamplingParams { prompt_logprobs: Some(0), ..SamplingParams::greedy(4) };
    let (_, worker, _) = cluster.submit(prompt, scoring, 0).expect("submitted");
    assert_eq!((worker, predicted()), (WorkerId(0), 32), "the scoring one goes to the idle worker");
}

/// Re-dispatch sends what was streamed as the request's output, with the
/// parameters unchanged: the next worker continues the seeded stream at the
/// same position and its penalties count those tokens. A sampled request
/// without a seed got one at submission, so it continues exactly too.
#[test]
fn redispatch_carries_the_streamed_tokens_as_output() {
    let (cluster, mut inboxes) = cluster_with_workers(2, Policy::RoundRobin);
    let params = SamplingParams {
        temperature: 0.8,
        frequency_penalty: 0.5,
        min_tokens: 4,
        max_tokens: 10,
        ..SamplingParams::default()
    };
    let (id, first, _events) = cluster.submit(vec![1, 2, 3], params.clone(), 0).expect("submitted");
    let (_, _, sent) = generate_sent(&mut inboxes[first.0 as usize]).expect("sent");
    let seed = sent.seed.expect("the coordinator seeds a sampled request");
    cluster.on_worker_message(first, delta(id, vec![], vec![7, 8]));
    cluster.remove_worker(first, "test");
    let next = cluster.request_worker(id).expect("re-dispatched");
    let (prompt, output, resent) = generate_sent(&mut inboxes[next.0 as usize]).expect("sent to the next worker");
    assert_eq!((prompt, output), (vec![1, 2, 3], vec![7, 8]));
    assert_eq!(resent, SamplingParams { seed: Some(seed), ..params }, "max_tokens and min_tokens unchanged");
    assert_eq!(cluster.redispatches(), 1);
}

/// The supervisor saw a local worker's process exit: it is gone at once
/// and its requests are already on another worker.
#[test]
fn a_worker_whose_process_exited_is_dropped_at_once() {
    let (cluster, mut inboxes) = cluster_with_workers(2, Policy::RoundRobin);
    let (id, first, _events) = cluster.submit(vec![1, 2, 3], SamplingParams::greedy(8), 0).expect("submitted");
    cluster.on_worker_message(first, delta(id, vec![], vec![5]));
    cluster.worker_process_exited(&format!("w{}", first.0), "signal: 9 (SIGKILL)");
    assert_eq!(cluster.workers().len(), 1);
    let next = cluster.request_worker(id).expect("re-dispatched");
    assert_ne!(next, first);
    assert_eq!(generate_sent(&mut inboxes[next.0 as usize]).map(|g| g.1), Some(vec![5]));
    cluster.worker_process_exited("no-such-worker", "exit status: 0");
    assert_eq!(cluster.workers().len(), 1);
}

/// A worker that announced it drains gets no new requests, and one it
/// refuses for that reason goes elsewhere instead of failing.
#[test]
fn a_draining_worker_is_routed_around() {
    let (cluster, mut inboxes) = cluster_with_workers(2, Policy::RoundRobin);
    let (id, first, mut events) = cluster.submit(vec![1, 2, 3], SamplingParams::greedy(8), 0).expect("submitted");
    cluster.on_worker_message(first, WorkerMessage::Draining);
    let message = "worker is draining".to_string();
    cluster.on_worker_message(first, WorkerMessage::Rejected { request_id: id, message });
    let next = cluster.request_worker(id).expect("re-dispatched, not failed");
    assert_ne!(next, first);
    assert!(generate_sent(&mut inboxes[next.0 as usize]).is_some());
    assert!(events.try_recv().is_err(), "nothing failed");
    for _ in 0..4 {
        let (_, worker, _) = cluster.submit(vec![4, 5], SamplingParams::greedy(2), 0).expect("submitted");
        assert_eq!(worker, next);
    }
}

/// `/v1/workers` counts a dispatch at once: the ledger and the request
/// table, not the worker's next stats.
#[test]
fn worker_load_shows_dispatches_at_once() {
    let (cluster, _inboxes) = cluster_with_workers(3, Policy::PrefixAware);
    let mut events = Vec::new();
    for i in 0..70u32 {
        let (id, worker, rx) = cluster.submit(vec![1, 2, 3, i], SamplingParams::greedy(8), 0).expect("submitted");
        events.push((id, worker, rx));
    }
    let (id, worker, _) = &events[0];
    cluster.on_worker_message(*worker, delta(*id, vec![], vec![9]));
    let infos = cluster.workers();
    let waiting: u32 = infos.iter().map(|w| w.load.waiting).sum();
    let running: u32 = infos.iter().map(|w| w.load.running).sum();
    assert_eq!((running, waiting), (1, 69));
    for w in &infos {
        assert!((20..=27).contains(&w.in_flight_requests), "{:?}", infos.iter().map(|w| w.in_flight_requests));
        assert_eq!(w.in_flight_requests, (w.load.running + w.load.waiting) as usize);
        assert_eq!(w.stats.num_running, 0, "the workers have not reported yet");
    }
}

/// The watchdog's runtime is starved for longer than 3 stats intervals
/// (as when HTTP handlers held every thread): no stats could be read
/// meanwhile, so the worker is not declared lost when it wakes.
#[test]
fn a_starved_watchdog_declares_no_false_loss() {
    let (cluster, _inboxes) = cluster_with_workers(1, Policy::RoundRobin);
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        tokio::spawn(cluster.clone().watchdog());
        let stats = || WorkerMessage::Stats(WorkerStats::default());
        // Stats arrive, then the runtime's only thread blocks for 4 intervals.
        tokio::time::sleep(STATS_INTERVAL / 2).await;
        cluster.on_worker_message(WorkerId(0), stats());
        tokio::time::sleep(STATS_INTERVAL / 2).await;
        std::thread::sleep(STATS_INTERVAL * 4);
        // The watchdog runs before any stats are read again.
        tokio::task::yield_now().await;
        tokio::time::sleep(STATS_INTERVAL / 10).await;
        assert_eq!(cluster.workers().len(), 1, "declared lost after a stall of the coordinator itself");
        // Silence that is the worker's own still counts.
        tokio::time::sleep(STATS_INTERVAL * (MISSED_STATS_LIMIT + 1)).await;
        assert_eq!(cluster.workers().len(), 0, "a silent worker is still declared lost");
    });
}

/// Every message a worker received since the last call.
fn received(inbox: &mut mpsc::UnboundedReceiver<CoordinatorMessage>) -> Vec<CoordinatorMessage> {
    std::iter::from_fn(|| inbox.try_recv().ok()).collect()
}

/// A prompt routed to a worker lacking the prefix another holds: the
/// holder is asked for the blocks, each frame is passed on, and the
/// request follows the last; a lost holder, or one past the deadline,
/// releases the request to compute its prompt.
#[test]
fn a_prefix_held_by_a_peer_is_fetched_before_the_request() {
    let prompt: Vec<u32> = (0..100).collect();
    let chain = common::hash_prompt_blocks(&prompt, 16);
    for ending in ["done", "holder lost", "late"] {
        let (cluster, mut inboxes) = cluster_with_workers_tiered(2, Policy::RoundRobin, true);
        for w in 0..2u64 {
            let hashes = if w == 0 { chain.iter().map(|&h| (h, None)).collect() } else { Vec::new() };
            let snapshot = WorkerMessage::KvSnapshot { last_event_id: None, hashes, offloaded: Vec::new() };
            cluster.on_worker_message(WorkerId(w), snapshot);
        }
        // Round robin: the first request goes to worker 0, this one to worker 1.
        cluster.submit(vec![1, 2, 3], SamplingParams::greedy(1), 0).expect("submitted");
        received(&mut inboxes[1]); // its snapshot request
        let (id, worker, _events) = cluster.submit(prompt.clone(), SamplingParams::greedy(4), 0).expect("submitted");
        assert_eq!(worker, WorkerId(1));
        let asked = received(&mut inboxes[0]);
        let Some(CoordinatorMessage::ExportKv { transfer, hashes }) = asked.last().cloned() else {
            panic!("the holder was not asked: {asked:?}")
        };
        assert_eq!(hashes, chain[..6].to_vec(), "the 6 usable blocks of 100 tokens");
        assert!(received(&mut inboxes[1]).is_empty(), "the request waits for its blocks");
        let block = |i: usize| common::protocol::KvBlock {
            hash: chain[i],
            parent: i.checked_sub(1).map(|p| chain[p]),
            tokens: prompt[i * 16..(i + 1) * 16].to_vec(),
            bytes: vec![i as u8; 8],
        };
        match ending {
            "done" => {
                let frame = |blocks, last| WorkerMessage::ExportedKv { transfer, blocks, last };
                cluster.on_worker_message(WorkerId(0), frame(vec![block(0), block(1)], false));
                cluster.on_worker_message(WorkerId(0), frame(vec![block(2)], true));
                let got = received(&mut inboxes[1]);
                assert_eq!(got.len(), 3, "{got:?}");
                assert!(matches!(&got[0], CoordinatorMessage::ImportKv { identity: 7, blocks } if blocks.len() == 2));
                assert!(matches!(&got[1], CoordinatorMessage::ImportKv { blocks, .. } if blocks.len() == 1));
                assert!(matches!(&got[2], CoordinatorMessage::Generate { request_id, .. } if *request_id == id));
            }
            "holder lost" => {
                cluster.remove_worker(WorkerId(0), "test");
                // The request waiting for the blocks, and the lost worker's own request, moved.
                let got = received(&mut inboxes[1]);
                let generated = |m: &CoordinatorMessage| matches!(m, CoordinatorMessage::Generate { request_id, .. } if *request_id == id);
                assert!(got.iter().any(generated), "{got:?}");
                assert!(!got.iter().any(|m| matches!(m, CoordinatorMessage::ImportKv { .. })), "{got:?}");
                // A frame arriving after is dropped.
                let late = WorkerMessage::ExportedKv { transfer, blocks: vec![block(0)], last: true };
                cluster.on_worker_message(WorkerId(0), late);
                assert!(received(&mut inboxes[1]).is_empty());
            }
            _ => {
                let later = std::time::Instant::now() + std::time::Duration::from_secs(60);
                let mut state = cluster.lock();
                cluster.expire_fetches(&mut state, later);
                drop(state);
                let got = received(&mut inboxes[1]);
                assert!(matches!(got.as_slice(), [CoordinatorMessage::Generate { .. }]), "{got:?}");
            }
        }
    }
}
