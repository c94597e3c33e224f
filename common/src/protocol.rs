//! The coordinator <-> worker wire protocol: bincode-encoded messages in
//! length-prefixed frames (u32 little-endian length, then the payload) over
//! QUIC streams. Decoding is defensive: a frame longer than
//! [`MAX_FRAME_BYTES`], a truncated payload, trailing bytes or a malformed
//! body is an error for that connection, never a panic or a huge allocation.

use serde::{Deserialize, Serialize, de::DeserializeOwned};

pub use crate::sampling::TokenLogprobs;
use crate::{KvEventRecord, RequestId, SamplingParams, WorkerId};

/// Bumped on any incompatible change of the messages below or of the block hash.
pub const PROTOCOL_VERSION: u32 = 14;

/// Largest frame payload either side accepts (a 128k-token prompt is ~0.5 MB).
pub const MAX_FRAME_BYTES: usize = 8 << 20;

/// Largest frame a peer that has not authenticated yet may send: its
/// `Handshake` is a few hundred bytes, so nothing bigger is read (or
/// allocated) for a stranger.
pub const MAX_HELLO_FRAME_BYTES: usize = 64 << 10;

/// How often a worker reports its stats; the coordinator declares a worker
/// lost after a few missed intervals.
pub const STATS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Bytes of the length prefix.
pub const FRAME_HEADER_BYTES: usize = 4;

/// Which model a worker serves; the coordinator refuses a worker whose
/// model differs from its own.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelIdentity {
    pub name: String,
    /// Hash of the model's config.json, so two different checkpoints under
    /// one name are told apart.
    pub config_hash: u64,
}

/// `ModelIdentity::config_hash` of a model's config.json bytes.
pub fn config_hash(config_json: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(config_json)
}

/// The first frame a worker sends on its control stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Handshake {
    pub protocol_version: u32,
    pub worker_name: String,
    pub model: ModelIdentity,
    pub block_size: u32,
    pub kv_capacity_blocks: u64,
    pub max_model_len: u64,
    /// Where the worker serves Prometheus metrics (HOST:PORT), if it does;
    /// the coordinator lists it for Prometheus service discovery.
    pub metrics_address: Option<String>,
    /// What the engine runs on, in words ("cpu (avx2, 2 threads)", "metal
    /// (Apple M2)", or "cpu (Metal requested but unavailable: ...)").
    pub device: String,
    /// The worker's pipeline, first stage (this worker) first; one entry,
    /// itself with every layer, for a worker that is no pipeline. Each
    /// stage's layers and resident memory (weights, KV cache).
    pub stages: Vec<crate::pipeline::StageInfo>,
    /// How the worker found the coordinator (for `/v1/workers`).
    pub joined_by: JoinedBy,
    /// The worker's stable id, kept in its state directory: a second live
    /// worker with the same one is refused.
    pub instance_id: String,
    /// Proof that the worker knows the cluster secret, bound to this TLS
    /// session (`transport::auth_tag`): the secret itself never travels.
    pub auth_tag: Vec<u8>,
    /// Its KV blocks' identity (model, weights, cache format, block size,
    /// layers): blocks move between peers of one identity only.
    pub kv_identity: u64,
    /// Bytes of one KV block (every layer's K and V).
    pub kv_block_bytes: u64,
    /// Whether it keeps blocks a peer sends (it has a second tier).
    pub kv_tier: bool,
}

/// One KV block as a peer sends it (a prefix fetched from the worker that
/// holds it): the chain position it is checked against, and its K and V
/// in every layer as the pool stores them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvBlock {
    pub hash: crate::BlockHash,
    pub parent: Option<crate::BlockHash>,
    pub tokens: Vec<u32>,
    pub bytes: Vec<u8>,
}

/// The `transfer` of `ExportedKv` frames a draining worker sends unasked
/// before it exits: its cached blocks, for the coordinator to pass to a
/// peer that keeps them (its sessions' next turns then find them there).
/// The coordinator answers the last frame with `HandedOff`.
pub const KV_HANDOFF: u64 = u64::MAX;

/// Most bytes of blocks one `ExportedKv` frame carries (a frame is at most
/// [`MAX_FRAME_BYTES`]); a block larger than this is not sent.
pub const KV_EXPORT_FRAME_BYTES: usize = 4 << 20;

/// How a worker found the coordinator it registers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinedBy {
    /// Started by the coordinator itself (`--local-workers`).
    Local,
    /// `--coordinator HOST:PORT`.
    Address,
    /// The address in its join token.
    Token,
    /// mDNS discovery on the local network.
    Discovery,
}

impl JoinedBy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::Address => "address",
            Self::Token => "join token",
            Self::Discovery => "discovery",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum HandshakeReply {
    /// `auth_tag` proves the coordinator knows the secret too, so a worker
    /// never serves a man in the middle.
    Accepted {
        worker_id: WorkerId,
        auth_tag: Vec<u8>,
    },
    Refused {
        reason: String,
    },
    /// Not now: an older session with this worker's id is still registered
    /// (it restarted before the coordinator noticed it had gone). The
    /// worker retries; the old session is dropped within the liveness bound.
    Later {
        reason: String,
    },
}

/// The first frame a worker sends on its control stream: a registration,
/// or (`--layers auto`) an offer to hold whatever layers the coordinator
/// assigns it, made before it loads any weights.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum WorkerHello {
    Register(Handshake),
    Offer(StageOffer),
    /// A worker fetching and loading its weights says so, then streams
    /// [`PrepareProgress`] until it registers (or, as a later stage, links).
    Prepare(Preparing),
}

/// A worker about to download and load its stage's weights (issue 57): it
/// shows in `/v1/workers` with its progress until it is ready. Answered as
/// an offer is, `OfferReply::Accepted` or `Refused`; then the worker sends
/// [`PrepareProgress`] frames and finishes the stream when it is done.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Preparing {
    pub protocol_version: u32,
    pub worker_name: String,
    pub model: ModelIdentity,
    pub block_size: u32,
    /// The layers it will hold, inclusive ("0-11"), as `StageInfo::layers`.
    pub layers: String,
    pub joined_by: JoinedBy,
    /// As `Handshake::auth_tag`.
    pub auth_tag: Vec<u8>,
}

/// What a preparing worker is doing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum PreparePhase {
    /// Fetching its stage's files from the hub.
    #[default]
    Downloading,
    /// Reading its weights into memory.
    Loading,
}

impl PreparePhase {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Downloading => "downloading",
            Self::Loading => "loading",
        }
    }
}

/// A preparing worker's progress, sent when it changes (a few times a second at most).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrepareProgress {
    pub phase: PreparePhase,
    pub download: DownloadProgress,
}

/// How far a model download is: files of its plan (config and tokenizer
/// files, then the stage's weight shards) and bytes fetched. A file already
/// in the cache counts as done with no bytes fetched.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DownloadProgress {
    pub files_done: u32,
    /// Known once the weights index is read; until then the files named so far.
    pub files_total: u32,
    /// Bytes fetched so far, over every file.
    pub bytes_done: u64,
    /// The file being fetched ("" between files), its bytes fetched and size.
    pub file: String,
    pub file_bytes_done: u64,
    pub file_bytes_total: u64,
}

/// A worker's offer to be a replica or a pipeline stage (issue 30): what
/// the coordinator needs to split the model's layers by memory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageOffer {
    pub protocol_version: u32,
    pub worker_name: String,
    pub model: ModelIdentity,
    pub block_size: u32,
    /// Bytes this worker can give the model: its weights and KV cache
    /// (`--memory-limit`, else the memory available at start).
    pub memory_bytes: u64,
    /// Bytes the whole model's weights take at this worker's dtype.
    pub model_weight_bytes: u64,
    /// Where it will listen for the stage before it if it becomes a later
    /// stage; an unspecified host (0.0.0.0, ::) stands for the address the
    /// coordinator sees the offer come from.
    pub stage_listen: std::net::SocketAddr,
    /// What the engine will run on, in words (as in `Handshake::device`).
    pub device: String,
    /// As `Handshake::auth_tag`.
    pub auth_tag: Vec<u8>,
}

/// Coordinator -> an offering worker. The first reply is `Accepted` or
/// `Refused`; an accepted offer then hears `Waiting` while no pipeline can
/// be formed with it, and finally `Assigned`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum OfferReply {
    /// The offer is held; `auth_tag` proves the coordinator knows the secret.
    Accepted {
        auth_tag: Vec<u8>,
    },
    /// Why no pipeline can be formed yet (sent when that changes).
    Waiting {
        why: String,
    },
    Assigned(StageAssignment),
    Refused {
        reason: String,
    },
}

/// The layers an offering worker is to hold, and whom it links to. Stage 0
/// then registers with a `Handshake` as a pinned first stage does.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageAssignment {
    /// The pipeline's name (its first stage's worker name).
    pub pipeline: String,
    pub stage: u32,
    pub stages: u32,
    pub layers: crate::pipeline::LayerRange,
    /// The next stage's address, HOST:PORT (none on the last stage).
    pub next_stage: Option<String>,
}

/// Coordinator -> worker.
// `Generate` is the large one and the common one: boxing it would add an
// allocation per request to save a few hundred bytes of a short-lived value.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CoordinatorMessage {
    Generate {
        request_id: RequestId,
        prompt_token_ids: Vec<u32>,
        /// Tokens this request already generated on a worker that was lost
        /// (empty for a new request). The worker continues after them as
        /// its own output, so penalties count them, the seeded draw goes on
        /// at the same position, and `max_tokens`/`min_tokens` keep their
        /// meaning: the continuation equals a run without the loss.
        output_token_ids: Vec<u32>,
        params: SamplingParams,
        /// Scheduling priority (vLLM's): lower runs first, and under the
        /// worker's `--scheduling-policy priority` a lower-priority running
        /// request is preempted for it; ignored under `fcfs`.
        priority: i32,
    },
    Abort {
        request_id: RequestId,
    },
    /// Send every cached block hash again (after an event-id gap).
    RequestKvSnapshot,
    /// Send these blocks (a prefix chain, in order) for a peer: as many of
    /// the leading ones as it holds, in `ExportedKv` frames.
    ExportKv {
        transfer: u64,
        hashes: Vec<crate::BlockHash>,
    },
    /// The draining worker's handoff (`KV_HANDOFF`) was passed on: it may exit.
    HandedOff,
    /// Blocks a peer of KV identity `identity` sent: keep them in the
    /// second tier (each checked).
    ImportKv {
        identity: u64,
        blocks: Vec<KvBlock>,
    },
    /// Finish in-flight requests, accept no new ones.
    Drain,
    Shutdown,
}

/// Why a request ended: the engine's verdict, the wire's, and (as
/// `"stop"`/`"length"`) OpenAI's `finish_reason`. One definition for all three.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS, a stop token, or (decided by the coordinator) a stop string.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    /// Cancelled: the client went away or the request was refused mid-way.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// A worker's load, sent at least every second.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    pub num_running: u32,
    pub num_waiting: u32,
    pub kv_blocks_total: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_cached: u64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    /// Tokens a second its steps compute while they prefill (a moving
    /// average over steps of 64 tokens or more; 0 before the first): what
    /// recomputing a prefix costs there, against fetching it from a peer.
    pub prefill_tokens_per_s: f32,
}

/// Worker -> coordinator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum WorkerMessage {
    /// New tokens of one request since the last delta (coalesced per step).
    TokenDelta {
        request_id: RequestId,
        /// Log-probabilities of the next prompt tokens, when the request
        /// asked for `prompt_logprobs`: in prompt order from the second
        /// token on, each exactly once, all before the first new token.
        prompt_logprobs: Vec<TokenLogprobs>,
        new_token_ids: Vec<u32>,
        logprobs: Vec<TokenLogprobs>,
        finish_reason: Option<FinishReason>,
        num_prompt_tokens: u32,
        num_cached_tokens: u32,
    },
    /// The worker could not accept a request (bad input, draining).
    Rejected {
        request_id: RequestId,
        message: String,
    },
    Stats(WorkerStats),
    /// The worker takes no new requests (SIGTERM): it finishes those it
    /// has, then closes the connection with `transport::DRAINED_CLOSE_REASON`.
    Draining,
    KvEvents(Vec<KvEventRecord>),
    /// Blocks of an `ExportKv`, in chain order; `last` on the final frame.
    ExportedKv {
        transfer: u64,
        blocks: Vec<KvBlock>,
        last: bool,
    },
    /// Every hash the worker's prefix cache holds, after `RequestKvSnapshot`;
    /// `last_event_id` is the id of the last event it reflects.
    KvSnapshot {
        last_event_id: Option<u64>,
        hashes: Vec<(crate::BlockHash, Option<crate::BlockHash>)>,
        /// Those its second tier holds (host memory or disk).
        offloaded: Vec<crate::BlockHash>,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("frame of {len} bytes exceeds the {limit}-byte limit")]
    FrameTooLarge { len: usize, limit: usize },
    #[error("frame truncated: {got} of {expected} bytes")]
    Truncated { expected: usize, got: usize },
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    #[error("malformed message: {0}")]
    Decode(String),
    #[error("cannot encode message: {0}")]
    Encode(String),
}

fn config() -> impl bincode::config::Config {
    // The limit bounds every allocation the decoder makes from lengths it reads.
    bincode::config::standard().with_limit::<MAX_FRAME_BYTES>()
}

/// Header + payload of one message.
pub fn encode_frame<T: Serialize>(message: &T) -> Result<Vec<u8>, ProtocolError> {
    let payload = bincode::serde::encode_to_vec(message, config()).map_err(|e| ProtocolError::Encode(e.to_string()))?;
    if payload.len() > MAX_FRAME_BYTES {
        return Err(ProtocolError::FrameTooLarge { len: payload.len(), limit: MAX_FRAME_BYTES });
    }
    let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// The payload length announced by a header, checked against the limit
/// before anything is allocated for it.
pub fn frame_len(header: [u8; FRAME_HEADER_BYTES]) -> Result<usize, ProtocolError> {
    frame_len_within(header, MAX_FRAME_BYTES)
}

/// `frame_len` under a tighter `limit` (at most `MAX_FRAME_BYTES`), e.g.
/// `MAX_HELLO_FRAME_BYTES` before the peer has authenticated.
pub fn frame_len_within(header: [u8; FRAME_HEADER_BYTES], limit: usize) -> Result<usize, ProtocolError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > limit.min(MAX_FRAME_BYTES) {
        return Err(ProtocolError::FrameTooLarge { len, limit: limit.min(MAX_FRAME_BYTES) });
    }
    Ok(len)
}

/// Decodes one payload, which must be consumed exactly.
pub fn decode_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ProtocolError> {
    let (message, used) =
        bincode::serde::decode_from_slice(payload, config()).map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if used != payload.len() {
        return Err(ProtocolError::TrailingBytes(payload.len() - used));
    }
    Ok(message)
}

/// `decode_payload` for a frame read under `MAX_HELLO_FRAME_BYTES`: no
/// length inside it may claim more than that either, so a stranger's
/// frame cannot make the decoder reserve megabytes.
pub fn decode_small_payload<T: DeserializeOwned>(payload: &[u8]) -> Result<T, ProtocolError> {
    let config = bincode::config::standard().with_limit::<MAX_HELLO_FRAME_BYTES>();
    let (message, used) =
        bincode::serde::decode_from_slice(payload, config).map_err(|e| ProtocolError::Decode(e.to_string()))?;
    if used != payload.len() {
        return Err(ProtocolError::TrailingBytes(payload.len() - used));
    }
    Ok(message)
}

/// Decodes a whole frame (header + payload) from a buffer.
pub fn decode_frame<T: DeserializeOwned>(frame: &[u8]) -> Result<T, ProtocolError> {
    let header: [u8; FRAME_HEADER_BYTES] = frame
        .get(..FRAME_HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or(ProtocolError::Truncated { expected: FRAME_HEADER_BYTES, got: frame.len() })?;
    let len = frame_len(header)?;
    let payload = &frame[FRAME_HEADER_BYTES..];
    if payload.len() < len {
        return Err(ProtocolError::Truncated { expected: len, got: payload.len() });
    }
    if payload.len() > len {
        return Err(ProtocolError::TrailingBytes(payload.len() - len));
    }
    decode_payload(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BlockHash, KvEvent};
    use proptest::prelude::*;

    fn samples() -> Vec<WorkerMessage> {
        vec![
            WorkerMessage::TokenDelta {
                request_id: RequestId(7),
                prompt_logprobs: vec![TokenLogprobs { logprob: -2.0, top: vec![(4, -0.1)] }],
                new_token_ids: vec![1, 2, 3],
                logprobs: vec![TokenLogprobs { logprob: -0.5, top: vec![(1, -0.5), (9, -1.5)] }],
                finish_reason: Some(FinishReason::Length),
                num_prompt_tokens: 12,
                num_cached_tokens: 0,
            },
            WorkerMessage::Stats(WorkerStats { num_running: 3, kv_blocks_total: 100, ..WorkerStats::default() }),
            WorkerMessage::KvEvents(vec![KvEventRecord {
                id: 4,
                event: KvEvent::Stored { hash: BlockHash(9), parent: None },
            }]),
        ]
    }

    #[test]
    fn messages_round_trip() {
        for message in samples() {
            let frame = encode_frame(&message).unwrap();
            assert_eq!(decode_frame::<WorkerMessage>(&frame).unwrap(), message);
        }
        let generate = CoordinatorMessage::Generate {
            request_id: RequestId(1),
            prompt_token_ids: vec![1, 2],
            output_token_ids: vec![3],
            params: SamplingParams::greedy(4),
            priority: -3,
        };
        assert_eq!(decode_frame::<CoordinatorMessage>(&encode_frame(&generate).unwrap()).unwrap(), generate);
        let offer = WorkerHello::Offer(StageOffer {
            protocol_version: PROTOCOL_VERSION,
            worker_name: "mac-2".into(),
            model: ModelIdentity { name: "m".into(), config_hash: 9 },
            block_size: 16,
            memory_bytes: 8 << 30,
            model_weight_bytes: 3 << 30,
            stage_listen: "0.0.0.0:7071".parse().unwrap(),
            device: "metal".into(),
            auth_tag: vec![1; 32],
        });
        assert_eq!(decode_frame::<WorkerHello>(&encode_frame(&offer).unwrap()).unwrap(), offer);
        let assigned = OfferReply::Assigned(StageAssignment {
            pipeline: "mac-1".into(),
            stage: 1,
            stages: 2,
            layers: crate::pipeline::LayerRange { start: 11, end: 22, total: 22 },
            next_stage: None,
        });
        assert_eq!(decode_frame::<OfferReply>(&encode_frame(&assigned).unwrap()).unwrap(), assigned);
    }

    #[test]
    fn oversized_truncated_and_trailing_frames_are_errors() {
        let header = ((MAX_FRAME_BYTES + 1) as u32).to_le_bytes();
        assert!(matches!(frame_len(header), Err(ProtocolError::FrameTooLarge { .. })));
        let hello_header = ((MAX_HELLO_FRAME_BYTES + 1) as u32).to_le_bytes();
        assert!(frame_len(hello_header).is_ok());
        assert!(matches!(
            frame_len_within(hello_header, MAX_HELLO_FRAME_BYTES),
            Err(ProtocolError::FrameTooLarge { len, limit: MAX_HELLO_FRAME_BYTES }) if len == MAX_HELLO_FRAME_BYTES + 1
        ));
        let frame = encode_frame(&samples()[0]).unwrap();
        assert!(matches!(
            decode_frame::<WorkerMessage>(&frame[..frame.len() - 1]),
            Err(ProtocolError::Truncated { .. })
        ));
        let mut longer = frame.clone();
        longer.push(0);
        assert!(decode_frame::<WorkerMessage>(&longer).is_err());
        assert!(decode_frame::<WorkerMessage>(&[1, 0]).is_err());
    }

    #[test]
    fn a_huge_length_inside_the_payload_does_not_allocate_it() {
        // Variant 0 (TokenDelta), request id, then a Vec length of 2^60.
        let mut payload = vec![0u8, 7];
        payload.push(255); // bincode varint marker for u64
        payload.extend_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(decode_payload::<WorkerMessage>(&payload).is_err());
    }

    proptest! {
        /// Fuzz: arbitrary bytes never panic the decoder.
        #[test]
        fn decoder_never_panics_on_garbage(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_frame::<WorkerMessage>(&bytes);
            let _ = decode_frame::<CoordinatorMessage>(&bytes);
            let _ = decode_payload::<Handshake>(&bytes);
            let _ = decode_small_payload::<WorkerHello>(&bytes);
            let _ = decode_payload::<OfferReply>(&bytes);
        }

        /// Fuzz: every corruption of a valid frame is an error or a valid message, never a panic.
        #[test]
        fn corrupted_frames_never_panic(index in 0usize..64, value in any::<u8>(), cut in 0usize..64) {
            for message in samples() {
                let mut frame = encode_frame(&message).unwrap();
                let i = index % frame.len();
                frame[i] = value;
                let _ = decode_frame::<WorkerMessage>(&frame);
                let _ = decode_frame::<WorkerMessage>(&frame[..cut.min(frame.len())]);
            }
        }
    }
}
