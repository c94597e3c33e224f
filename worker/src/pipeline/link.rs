//! The QUIC link between two stages, over `common::transport`: the same TLS
//! configs, framing and cluster-secret proof as the coordinator link. The
//! stage before dials (and proves itself as `Role::Worker`); the stage after
//! listens (and answers as `Role::Coordinator`, so a reflected tag is
//! useless). One bidirectional stream carries steps forward and results back.
//!
//! Frames are read by tasks of their own (`read_frame` is not cancel-safe);
//! the rest of the worker talks to a link through channels.

use std::net::SocketAddr;
use std::time::Instant;

use common::protocol::{MAX_FRAME_BYTES, MAX_HELLO_FRAME_BYTES};
use common::transport::{self, Role, TransportError};
use tokio::sync::mpsc;

use crate::error::WorkerError;

use super::wire::{MAX_RAW_BYTES, StageHello, StageInfo, StageReply, StepHeader, StepResult};

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("stage address {0:?}: {1}")]
    Address(String, String),
    #[error("connection: {0}")]
    Connection(String),
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error("the next stage refused this one: {0}")]
    Refused(String),
    #[error("the next stage failed to prove it knows the cluster secret")]
    NotAuthenticated,
    #[error("the link closed during the handshake")]
    Closed,
    #[error("a raw payload of {0} bytes is over the limit")]
    TooLarge(u64),
    /// A stage formed by the coordinator (`--layers auto`) lost the stage
    /// before or after it: its pipeline is gone, and it offers itself again.
    #[error("pipeline lost: {0}")]
    Unlinked(String),
}

/// A frame and the raw bytes that follow it.
pub type Framed<T> = (T, Vec<u8>);

/// A frame read off a link: its raw bytes, when it was read, and its size
/// on the wire (frame and raw bytes).
pub struct Arrived<T> {
    pub frame: T,
    pub raw: Vec<u8>,
    pub at: Instant,
    pub bytes: usize,
}

/// The link to the next stage, as the stage before holds it.
pub struct Downstream {
    /// The least KV block count of every stage after this one.
    pub num_blocks: u64,
    /// Every stage after this one, in order.
    pub stages: Vec<StageInfo>,
    /// Encoded step frames and their hidden-state bytes, for the writer task.
    steps: mpsc::UnboundedSender<(Vec<u8>, Vec<u8>)>,
    /// Results coming back; closed when the link is lost.
    pub results: mpsc::UnboundedReceiver<Arrived<StepResult>>,
}

impl Downstream {
    /// Queues a step for the next stage (encoded here, written by the
    /// link's task); returns its size on the wire.
    pub fn send(&self, header: &StepHeader, hidden: Vec<u8>) -> Result<usize, WorkerError> {
        let frame = common::protocol::encode_frame(header).map_err(|e| WorkerError::Unsupported(e.to_string()))?;
        let bytes = frame.len() + hidden.len();
        self.steps.send((frame, hidden)).map_err(|_| lost("the link to the next stage is closed"))?;
        Ok(bytes)
    }

    /// Waits for the next result, blocking (the first stage's engine
    /// thread; never call it from async code).
    pub fn recv_blocking(&mut self) -> Result<Arrived<StepResult>, WorkerError> {
        self.results.blocking_recv().ok_or_else(|| lost("the next stage went away"))
    }

    /// The next result if one is back already.
    /// Whether the link has closed with nothing left to read: the next
    /// stage is gone.
    pub fn is_lost(&self) -> bool {
        self.results.is_closed() && self.results.is_empty()
    }

    pub fn try_recv(&mut self) -> Result<Option<Arrived<StepResult>>, WorkerError> {
        match self.results.try_recv() {
            Ok(result) => Ok(Some(result)),
            Err(mpsc::error::TryRecvError::Empty) => Ok(None),
            Err(mpsc::error::TryRecvError::Disconnected) => Err(lost("the next stage went away")),
        }
    }
}

fn lost(why: &str) -> WorkerError {
    WorkerError::PipelineLost(why.to_string())
}

/// [`dial`], again every `RETRY` while the next stage is not up yet (it
/// may still be loading); a refusal or a wrong secret is final.
pub async fn dial_until_up(address: &str, secret: &str, hello: StageHello) -> Result<Downstream, LinkError> {
    const RETRY: std::time::Duration = std::time::Duration::from_millis(200);
    let mut attempts = 0u32;
    loop {
        match dial(address, secret, hello.clone()).await {
            Ok(downstream) => return Ok(downstream),
            Err(e @ (LinkError::Refused(_) | LinkError::NotAuthenticated | LinkError::Address(..))) => return Err(e),
            Err(e) => {
                if attempts.is_multiple_of(25) {
                    tracing::warn!("stage: next stage at {address} not reachable yet ({e}); retrying");
                }
                attempts += 1;
                tokio::time::sleep(RETRY).await;
            }
        }
    }
}

/// Dials the next stage at `address`, proves the secret, and starts the
/// link's reader and writer tasks (on the current tokio runtime).
pub async fn dial(address: &str, secret: &str, mut hello: StageHello) -> Result<Downstream, LinkError> {
    let addr = resolve(address).await?;
    let endpoint = transport::client_endpoint(addr)?;
    let conn = endpoint
        .connect(addr, transport::SERVER_NAME)
        .map_err(|e| LinkError::Connection(e.to_string()))?
        .await
        .map_err(|e| LinkError::Connection(e.to_string()))?;
    let binding = transport::channel_binding(&conn)?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| LinkError::Connection(e.to_string()))?;
    hello.auth_tag = transport::auth_tag(secret.as_bytes(), Role::Worker, &binding);
    transport::write_frame(&mut send, &hello).await?;
    let (num_blocks, stages) = match transport::read_frame::<StageReply>(&mut recv).await? {
        Some(StageReply::Accepted { auth_tag, num_blocks, stages }) => {
            if !transport::verify_auth_tag(secret.as_bytes(), Role::Coordinator, &binding, &auth_tag) {
                return Err(LinkError::NotAuthenticated);
            }
            (num_blocks, stages)
        }
        Some(StageReply::Refused { reason }) => return Err(LinkError::Refused(reason)),
        None => return Err(LinkError::Closed),
    };
    transport::trust_connection(&conn);
    let (steps, mut outgoing) = mpsc::unbounded_channel::<(Vec<u8>, Vec<u8>)>();
    let (results_tx, results) = mpsc::unbounded_channel();
    let writer_conn = conn.clone();
    tokio::spawn(async move {
        // Owns the endpoint: the link lives as long as steps may come.
        let _endpoint = endpoint;
        while let Some((frame, hidden)) = outgoing.recv().await {
            if send.write_all(&frame).await.is_err() || send.write_all(&hidden).await.is_err() {
                break;
            }
        }
        writer_conn.close(0u32.into(), b"stage link closed");
    });
    tokio::spawn(async move {
        while let Ok(Some(result)) = read_framed(&mut recv, StepResult::raw_bytes).await {
            if results_tx.send(result).is_err() {
                break;
            }
        }
        // Dropping `results_tx` tells the stage before that the link is gone.
        conn.close(0u32.into(), b"stage link lost");
    });
    Ok(Downstream { num_blocks, stages, steps, results })
}

/// The link from the stage before, as the stage after holds it.
pub struct Upstream {
    pub conn: quinn::Connection,
    pub send: quinn::SendStream,
    pub recv: quinn::RecvStream,
    pub hello: StageHello,
}

/// The endpoint a stage listens on for the stage before it.
pub fn listen(addr: SocketAddr) -> Result<quinn::Endpoint, LinkError> {
    let (cert, key) = transport::self_signed_cert()?;
    let config = transport::server_config(cert, key)?;
    quinn::Endpoint::server(config, addr).map_err(|e| LinkError::Connection(format!("listening on {addr}: {e}")))
}

/// Accepts one connection (`endpoint.accept()`) from the stage before: checks its proof of the secret, then
/// `check(hello)` (model, block size, layers); refuses with the reason, or
/// accepts with `accept`'s block count and stage list.
pub async fn accept(
    incoming: quinn::Incoming,
    secret: &str,
    check: impl Fn(&StageHello) -> Result<(), String>,
    num_blocks: u64,
    stages: Vec<StageInfo>,
) -> Result<Upstream, LinkError> {
    let conn = incoming.await.map_err(|e| LinkError::Connection(e.to_string()))?;
    let binding = transport::channel_binding(&conn)?;
    let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| LinkError::Connection(e.to_string()))?;
    let hello: StageHello =
        transport::read_frame_within(&mut recv, MAX_HELLO_FRAME_BYTES).await?.ok_or(LinkError::Closed)?;
    if !transport::verify_auth_tag(secret.as_bytes(), Role::Worker, &binding, &hello.auth_tag) {
        let reason = "wrong cluster secret".to_string();
        let _ = transport::write_frame(&mut send, &StageReply::Refused { reason: reason.clone() }).await;
        conn.close(1u32.into(), reason.as_bytes());
        return Err(LinkError::NotAuthenticated);
    }
    if let Err(reason) = check(&hello) {
        let _ = transport::write_frame(&mut send, &StageReply::Refused { reason: reason.clone() }).await;
        let _ = send.finish();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), send.stopped()).await;
        return Err(LinkError::Refused(reason));
    }
    let auth_tag = transport::auth_tag(secret.as_bytes(), Role::Coordinator, &binding);
    transport::write_frame(&mut send, &StageReply::Accepted { auth_tag, num_blocks, stages }).await?;
    transport::trust_connection(&conn);
    Ok(Upstream { conn, send, recv, hello })
}

/// Writes a frame, then its raw bytes; returns their size on the wire.
pub async fn write_framed<T: serde::Serialize>(
    send: &mut quinn::SendStream,
    frame: &T,
    raw: &[u8],
) -> Result<usize, TransportError> {
    let encoded = common::protocol::encode_frame(frame)?;
    send.write_all(&encoded).await?;
    send.write_all(raw).await?;
    Ok(encoded.len() + raw.len())
}

/// Reads a frame and the `raw_len(frame)` raw bytes that follow it;
/// `Ok(None)` when the peer finished the stream between frames.
pub async fn read_framed<T: serde::Serialize + serde::de::DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    raw_len: impl Fn(&T) -> u64,
) -> Result<Option<Arrived<T>>, LinkError> {
    let Some(frame) = transport::read_frame_within::<T>(recv, MAX_FRAME_BYTES).await? else { return Ok(None) };
    let len = raw_len(&frame);
    if len > MAX_RAW_BYTES {
        return Err(LinkError::TooLarge(len));
    }
    let mut raw = vec![0u8; len as usize];
    recv.read_exact(&mut raw).await.map_err(TransportError::from)?;
    // The frame's size as sent (bincode is deterministic): small beside the raw bytes.
    let bytes = common::protocol::encode_frame(&frame).map_or(0, |f| f.len()) + raw.len();
    Ok(Some(Arrived { frame, raw, at: Instant::now(), bytes }))
}

async fn resolve(host_port: &str) -> Result<SocketAddr, LinkError> {
    let mut addrs = tokio::net::lookup_host(host_port)
        .await
        .map_err(|e| LinkError::Address(host_port.to_string(), e.to_string()))?;
    addrs.next().ok_or_else(|| LinkError::Address(host_port.to_string(), "no address".into()))
}
