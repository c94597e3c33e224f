//! Fuzz target: the wire-frame decoder (`common::protocol`), for every
//! message type either side reads off a QUIC stream.
//!
//! Invariants: no input panics or allocates past the frame limit (the
//! fuzzer's malloc limit catches the latter); a frame that decodes
//! re-encodes to a canonical frame that decodes again and re-encodes to the
//! same bytes (bytes, not values: a float may be NaN); and a stream of
//! frames read the way `transport::read_frame` reads them (length prefix
//! checked first, then exactly that many bytes) never reads out of bounds.

use common::protocol::{
    self, CoordinatorMessage, FRAME_HEADER_BYTES, FinishReason, Handshake, HandshakeReply, MAX_FRAME_BYTES,
    ModelIdentity, OfferReply, PrepareProgress, TokenLogprobs, WorkerHello, WorkerMessage, WorkerStats,
};
use common::{BlockHash, KvEvent, KvEventRecord, RequestId, SamplingParams, WorkerId};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Runs one input through every decoder.
pub fn wire_frame(data: &[u8]) {
    whole_frame::<WorkerMessage>(data);
    whole_frame::<CoordinatorMessage>(data);
    whole_frame::<Handshake>(data);
    whole_frame::<WorkerHello>(data);
    whole_frame::<HandshakeReply>(data);
    whole_frame::<OfferReply>(data);
    whole_frame::<PrepareProgress>(data);
    // The worker reads the coordinator's frames and vice versa, one after another.
    frame_stream::<WorkerMessage>(data);
    frame_stream::<CoordinatorMessage>(data);
}

fn whole_frame<T: Serialize + DeserializeOwned>(data: &[u8]) {
    if let Ok(message) = protocol::decode_frame::<T>(data) {
        assert_canonical(&message);
    }
    if let Ok(message) = protocol::decode_payload::<T>(data) {
        assert_canonical(&message);
    }
}

/// `read_frame` over a buffer: a header, a checked length, that many bytes.
fn frame_stream<T: Serialize + DeserializeOwned>(mut data: &[u8]) {
    while let Some((header, rest)) = data.split_first_chunk::<FRAME_HEADER_BYTES>() {
        let Ok(len) = protocol::frame_len(*header) else { return };
        assert!(len <= MAX_FRAME_BYTES, "frame_len let {len} bytes through");
        let Some(payload) = rest.get(..len) else { return };
        match protocol::decode_payload::<T>(payload) {
            Ok(message) => assert_canonical(&message),
            Err(_) => return,
        }
        data = &rest[len..];
    }
}

fn assert_canonical<T: Serialize + DeserializeOwned>(message: &T) {
    let frame = protocol::encode_frame(message).expect("a decoded message encodes");
    let again: T = protocol::decode_frame(&frame).expect("a re-encoded frame decodes");
    let frame_again = protocol::encode_frame(&again).expect("a decoded message encodes");
    assert_eq!(frame, frame_again, "re-encoding is not stable");
}

/// Realistic frames of every message type, for the seed corpus.
pub fn wire_seeds() -> Vec<Vec<u8>> {
    let mut params = SamplingParams::greedy(16);
    params.stop_token_ids = vec![2, 151645];
    params.logit_bias = vec![(5, -100.0), (9, 2.5)];
    let mut sampled = SamplingParams::greedy(200);
    (sampled.temperature, sampled.top_p, sampled.top_k, sampled.seed) = (0.8, 0.95, 40, Some(1234));
    sampled.logprobs = Some(5);
    sampled.prompt_logprobs = Some(1);
    let coordinator = [
        CoordinatorMessage::Generate {
            request_id: RequestId(1),
            prompt_token_ids: vec![1, 415, 2936, 9060],
            output_token_ids: vec![],
            params,
            priority: 0,
        },
        CoordinatorMessage::Generate {
            request_id: RequestId(u64::MAX),
            prompt_token_ids: vec![0; 40],
            // A re-dispatched request resumes after what it already streamed.
            output_token_ids: vec![450, 29871],
            params: sampled,
            priority: -7,
        },
        CoordinatorMessage::Abort { request_id: RequestId(7) },
        CoordinatorMessage::RequestKvSnapshot,
        CoordinatorMessage::Drain,
        CoordinatorMessage::Shutdown,
    ];
    let logprobs = TokenLogprobs { logprob: -0.25, top: vec![(13, -0.25), (29, -1.75), (1, f32::NEG_INFINITY)] };
    let worker = [
        WorkerMessage::TokenDelta {
            request_id: RequestId(1),
            prompt_logprobs: vec![logprobs.clone(), TokenLogprobs { logprob: f32::NAN, top: vec![] }],
            new_token_ids: vec![450, 29871, 13],
            logprobs: vec![logprobs.clone(); 3],
            finish_reason: None,
            num_prompt_tokens: 4,
            num_cached_tokens: 0,
        },
        WorkerMessage::TokenDelta {
            request_id: RequestId(1),
            prompt_logprobs: vec![],
            new_token_ids: vec![2],
            logprobs: vec![],
            finish_reason: Some(FinishReason::Stop),
            num_prompt_tokens: 4,
            num_cached_tokens: 16,
        },
        WorkerMessage::Rejected { request_id: RequestId(3), message: "the worker is draining".into() },
        WorkerMessage::Draining,
        WorkerMessage::Stats(WorkerStats {
            num_running: 3,
            num_waiting: 1,
            kv_blocks_total: 512,
            ..Default::default()
        }),
        WorkerMessage::KvEvents(vec![
            KvEventRecord { id: 1, event: KvEvent::Stored { hash: BlockHash(0xdead_beef), parent: None } },
            KvEventRecord {
                id: 2,
                event: KvEvent::Stored { hash: BlockHash(7), parent: Some(BlockHash(0xdead_beef)) },
            },
            KvEventRecord { id: 3, event: KvEvent::Removed { hash: BlockHash(7) } },
            KvEventRecord { id: 4, event: KvEvent::Offloaded { hash: BlockHash(8), parent: None } },
            KvEventRecord { id: 5, event: KvEvent::OffloadRemoved { hash: BlockHash(8) } },
            KvEventRecord { id: 6, event: KvEvent::Cleared },
        ]),
        WorkerMessage::KvSnapshot {
            last_event_id: Some(6),
            hashes: vec![(BlockHash(1), None), (BlockHash(2), Some(BlockHash(1)))],
            offloaded: vec![BlockHash(3)],
        },
    ];
    let handshake = Handshake {
        protocol_version: protocol::PROTOCOL_VERSION,
        worker_name: "worker-0".into(),
        model: ModelIdentity { name: "tiny-qwen3".into(), config_hash: 0x1234_5678_9abc_def0 },
        block_size: 16,
        kv_capacity_blocks: 4096,
        max_model_len: 1024,
        metrics_address: Some("127.0.0.1:9100".into()),
        device: "cpu (avx2, 2 threads)".into(),
        stages: vec![common::pipeline::StageInfo {
            name: "worker-0".into(),
            layers: "0-27".into(),
            weight_bytes: 1 << 30,
            kv_bytes: 1 << 28,
            metrics_address: Some("127.0.0.1:9100".into()),
            kv_cache_dtype: "q8_0".into(),
            kv_capacity_tokens: 65_536,
        }],
        joined_by: common::protocol::JoinedBy::Address,
        instance_id: String::new(),
        auth_tag: vec![0xab; 32],
        kv_identity: 0x1234,
        kv_block_bytes: 1 << 20,
        kv_tier: true,
    };
    let replies = [
        HandshakeReply::Accepted { worker_id: WorkerId(0), auth_tag: vec![0xcd; 32] },
        HandshakeReply::Refused { reason: "model mismatch".into() },
    ];
    let mut seeds: Vec<Vec<u8>> = Vec::new();
    let mut add = |frame: Result<Vec<u8>, protocol::ProtocolError>| seeds.extend(frame.ok());
    coordinator.iter().for_each(|m| add(protocol::encode_frame(m)));
    worker.iter().for_each(|m| add(protocol::encode_frame(m)));
    add(protocol::encode_frame(&handshake));
    add(protocol::encode_frame(&WorkerHello::Register(handshake.clone())));
    replies.iter().for_each(|m| add(protocol::encode_frame(m)));
    // Several frames back to back, as a stream carries them.
    let stream: Vec<u8> = worker.iter().filter_map(|m| protocol::encode_frame(m).ok()).flatten().collect();
    seeds.push(stream);
    seeds
}
