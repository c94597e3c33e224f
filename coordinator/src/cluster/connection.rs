//! The QUIC side of the cluster: accepting worker connections, the
//! authenticated handshake, and each worker's frame loop. A connection has
//! a writer task fed by a channel (the registry holds its sender) and a
//! reader loop that hands every frame to the cluster under its lock.
//!
//! Nothing is held for a peer that has not proved the cluster secret:
//! at most [`MAX_UNAUTHENTICATED`] connections may be between their first
//! packet and an accepted handshake (more are refused), each has
//! [`AUTH_TIMEOUT`] to get there, may send a handshake frame of at most
//! `MAX_HELLO_FRAME_BYTES`, and has a small receive window until then.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::WorkerId;
use common::protocol::{
    CoordinatorMessage, Handshake, HandshakeReply, MAX_HELLO_FRAME_BYTES, ModelIdentity, OfferReply, PROTOCOL_VERSION,
    Preparing, StageOffer, WorkerHello, WorkerMessage,
};
use common::transport::{self, Role};
use tokio::sync::{Semaphore, mpsc};

use super::Cluster;
use crate::router::EventOutcome;

/// How long a connection has from its first packet to an accepted handshake.
pub const AUTH_TIMEOUT: Duration = Duration::from_secs(5);
/// Most connections that may be waiting to authenticate at once.
pub const MAX_UNAUTHENTICATED: usize = 64;

/// Why a connection ended before or after registering.
enum Ended {
    /// Refused, timed out or broken before the handshake was accepted.
    Unauthenticated(String),
    /// A registered worker's connection ended.
    Worker(WorkerId, String),
    /// An offer (`--layers auto`) was assigned layers, or withdrawn; or a
    /// preparing worker's report ended.
    Offer(Result<(), String>),
}

/// A connection that proved the secret: a worker registering, or one
/// offering itself as a stage (`--layers auto`).
enum Authenticated {
    Worker(quinn::Connection, Handshake, quinn::SendStream, quinn::RecvStream),
    Offer(quinn::Connection, StageOffer, quinn::SendStream),
    Prepare(quinn::Connection, Preparing, quinn::SendStream, quinn::RecvStream),
}

/// Why a connection is refused, and whether trying again later may succeed.
struct Refusal {
    reason: String,
    retry: bool,
}

/// What a refusal check reads of a handshake or an offer.
struct Credentials<'a> {
    protocol_version: u32,
    /// A registering worker's stable id (offers have none yet).
    instance_id: Option<&'a str>,
    auth_tag: &'a [u8],
    block_size: u32,
    model: &'a ModelIdentity,
}

impl Cluster {
    /// Accepts worker connections until the endpoint closes.
    pub async fn accept_workers(self, endpoint: quinn::Endpoint) {
        let unauthenticated = Arc::new(Semaphore::new(MAX_UNAUTHENTICATED));
        let mut refused_logged = false;
        while let Some(incoming) = endpoint.accept().await {
            let Ok(permit) = unauthenticated.clone().try_acquire_owned() else {
                // Log once per burst of refusals, not once per packet.
                if !refused_logged {
                    tracing::info!(
                        "{MAX_UNAUTHENTICATED} connections are already authenticating; refusing new \
                         ones (from {})",
                        incoming.remote_address()
                    );
                    refused_logged = true;
                }
                incoming.refuse();
                continue;
            };
            refused_logged = false;
            let cluster = self.clone();
            tokio::spawn(async move {
                let address = incoming.remote_address();
                let authenticated = tokio::time::timeout(AUTH_TIMEOUT, cluster.authenticate(incoming)).await;
                let result = match authenticated {
                    Ok(Ok(Authenticated::Worker(conn, hello, send, recv))) => {
                        drop(permit);
                        cluster.serve_worker(conn, &hello, send, recv).await
                    }
                    Ok(Ok(Authenticated::Offer(conn, offer, send))) => {
                        drop(permit);
                        Ended::Offer(cluster.serve_offer(conn, offer, send).await)
                    }
                    Ok(Ok(Authenticated::Prepare(conn, preparing, send, recv))) => {
                        drop(permit);
                        Ended::Offer(cluster.serve_prepare(conn, preparing, send, recv).await)
                    }
                    Ok(Err(why)) => Ended::Unauthenticated(why),
                    Err(_) => Ended::Unauthenticated(format!("no accepted handshake within {AUTH_TIMEOUT:?}")),
                };
                match result {
                    Ended::Unauthenticated(why) | Ended::Offer(Err(why)) => {
                        tracing::warn!("connection from {address}: {why}")
                    }
                    Ended::Offer(Ok(())) => {}
                    Ended::Worker(id, why) => cluster.remove_worker(id, &why),
                }
            });
        }
    }

    /// From the first packet to an accepted handshake or offer. The caller
    /// bounds it in time; dropping the connection on the error path closes it.
    async fn authenticate(&self, incoming: quinn::Incoming) -> Result<Authenticated, String> {
        let conn = incoming.await.map_err(|e| format!("QUIC handshake failed: {e}"))?;
        let address = conn.remote_address();
        let binding = transport::channel_binding(&conn).map_err(|e| e.to_string())?;
        let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
        let hello: WorkerHello = transport::read_frame_within(&mut recv, MAX_HELLO_FRAME_BYTES)
            .await
            .map_err(|e| {
                conn.close(1u32.into(), b"bad handshake");
                format!("bad handshake (a worker of another version? this coordinator speaks {PROTOCOL_VERSION}): {e}")
            })?
            .ok_or("closed before the handshake")?;
        let (name, credentials) = match &hello {
            WorkerHello::Register(h) => (
                &h.worker_name,
                Credentials {
                    protocol_version: h.protocol_version,
                    instance_id: Some(&h.instance_id),
                    auth_tag: &h.auth_tag,
                    block_size: h.block_size,
                    model: &h.model,
                },
            ),
            WorkerHello::Offer(o) => (
                &o.worker_name,
                Credentials {
                    protocol_version: o.protocol_version,
                    instance_id: None,
                    auth_tag: &o.auth_tag,
                    block_size: o.block_size,
                    model: &o.model,
                },
            ),
            WorkerHello::Prepare(p) => (
                &p.worker_name,
                Credentials {
                    protocol_version: p.protocol_version,
                    instance_id: None,
                    auth_tag: &p.auth_tag,
                    block_size: p.block_size,
                    model: &p.model,
                },
            ),
        };
        if let Some(Refusal { reason, retry }) = self.refusal(&credentials, &binding) {
            tracing::warn!("refusing worker {name:?} at {address}: {reason}");
            let _ = match hello {
                WorkerHello::Register(_) if retry => {
                    transport::write_frame(&mut send, &HandshakeReply::Later { reason: reason.clone() }).await
                }
                WorkerHello::Register(_) => {
                    transport::write_frame(&mut send, &HandshakeReply::Refused { reason: reason.clone() }).await
                }
                WorkerHello::Offer(_) | WorkerHello::Prepare(_) => {
                    transport::write_frame(&mut send, &OfferReply::Refused { reason: reason.clone() }).await
                }
            };
            let _ = send.finish();
            // Give the refusal time to arrive before the connection drops.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Err(reason);
        }
        transport::trust_connection(&conn);
        Ok(match hello {
            WorkerHello::Register(hello) => Authenticated::Worker(conn, hello, send, recv),
            WorkerHello::Offer(offer) => Authenticated::Offer(conn, offer, send),
            WorkerHello::Prepare(preparing) => Authenticated::Prepare(conn, preparing, send, recv),
        })
    }

    /// Answers an authenticated offer or preparing report: accepted, with
    /// the coordinator's own proof of the secret, bound to this session.
    pub(super) async fn accept_proving_the_secret(
        &self,
        conn: &quinn::Connection,
        send: &mut quinn::SendStream,
    ) -> Result<(), String> {
        let binding = transport::channel_binding(conn).map_err(|e| e.to_string())?;
        let auth_tag = transport::auth_tag(self.secret.as_bytes(), Role::Coordinator, &binding);
        transport::write_frame(send, &OfferReply::Accepted { auth_tag }).await.map_err(|e| e.to_string())
    }

    /// Registers an authenticated worker and runs its frame loop until the
    /// connection ends.
    async fn serve_worker(
        &self,
        conn: quinn::Connection,
        hello: &Handshake,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
    ) -> Ended {
        let address = conn.remote_address();
        let binding = match transport::channel_binding(&conn) {
            Ok(binding) => binding,
            Err(e) => return Ended::Unauthenticated(e.to_string()),
        };
        let (tx, mut rx) = mpsc::unbounded_channel::<CoordinatorMessage>();
        let worker_id = self.register_worker(hello, address, tx);
        let reply = HandshakeReply::Accepted {
            worker_id,
            auth_tag: transport::auth_tag(self.secret.as_bytes(), Role::Coordinator, &binding),
        };
        if let Err(e) = transport::write_frame(&mut send, &reply).await {
            return Ended::Worker(worker_id, e.to_string());
        }
        tracing::info!("worker {:?} at {address} registered as {worker_id}", hello.worker_name);
        let writer = tokio::spawn(async move {
            while let Some(message) = rx.recv().await {
                if transport::write_frame(&mut send, &message).await.is_err() {
                    break;
                }
            }
        });
        let why = loop {
            match transport::read_frame::<WorkerMessage>(&mut recv).await {
                Ok(Some(message)) => self.on_worker_message(worker_id, message),
                Ok(None) => break "stream closed".to_string(),
                Err(e) => break departure(&e),
            }
        };
        writer.abort();
        conn.close(0u32.into(), b"bye");
        Ended::Worker(worker_id, why)
    }

    /// Why a worker's handshake or offer is refused, if it is.
    fn refusal(&self, hello: &Credentials<'_>, binding: &[u8; 32]) -> Option<Refusal> {
        let refused = |reason: String| Some(Refusal { reason, retry: false });
        if hello.protocol_version != PROTOCOL_VERSION {
            return refused(format!(
                "protocol version {} (this coordinator speaks {PROTOCOL_VERSION})",
                hello.protocol_version
            ));
        }
        if !transport::verify_auth_tag(self.secret.as_bytes(), Role::Worker, binding, hello.auth_tag) {
            return refused("wrong cluster secret".into());
        }
        // The wire carries the block size as u32; the coordinator counts in usize.
        if usize::try_from(hello.block_size).ok() != Some(self.block_size) {
            return refused(format!(
                "block size {} (this coordinator routes with {}; start both with the same --block-size)",
                hello.block_size, self.block_size
            ));
        }
        if hello.model.config_hash != self.model.config_hash {
            return refused(format!("serves model {:?}, the cluster serves {:?}", hello.model.name, self.model.name));
        }
        if let Some(id) = hello.instance_id
            && let Some(other) = self.lock().registry.with_instance_id(id)
        {
            // Most often this worker itself, restarted before its old
            // session was noticed gone: it retries until that one is.
            let reason = format!(
                "worker {other:?} has the same id ({id}) and is connected: this worker restarted (retry), or two \
                 workers share one state directory (give each its own --name or --state-dir)"
            );
            return Some(Refusal { reason, retry: true });
        }
        None
    }

    /// Lists a worker that passed the handshake; `tx` reaches it.
    pub(super) fn register_worker(
        &self,
        hello: &Handshake,
        address: SocketAddr,
        tx: mpsc::UnboundedSender<CoordinatorMessage>,
    ) -> WorkerId {
        // Registered, with every stage of its pipeline: none is preparing now.
        let mut preparing = self.preparing_workers();
        preparing.registered(&hello.worker_name);
        for stage in &hello.stages {
            preparing.registered(&stage.name);
        }
        drop(preparing);
        let mut state = self.lock();
        let id = state.registry.register(hello, address, tx.clone());
        // Its cache may be warm (a reconnect): learn it before trusting events.
        state.router.add_worker(id);
        let _ = tx.send(CoordinatorMessage::RequestKvSnapshot);
        id
    }

    /// One frame from `worker`: token deltas and rejections go to the
    /// request table, stats and KV events to the registry and the router.
    pub(super) fn on_worker_message(&self, worker: WorkerId, message: WorkerMessage) {
        let mut guard = self.lock();
        let state = &mut *guard;
        match message {
            WorkerMessage::TokenDelta {
                request_id,
                prompt_logprobs,
                new_token_ids,
                logprobs,
                finish_reason,
                num_prompt_tokens: _,
                num_cached_tokens,
            } => {
                let delta = super::requests::Delta {
                    prompt_logprobs,
                    new_token_ids,
                    logprobs,
                    finish_reason,
                    num_cached_tokens,
                };
                self.on_token_delta(state, worker, request_id, delta);
            }
            WorkerMessage::Rejected { request_id, message } => self.on_rejected(state, worker, request_id, message),
            WorkerMessage::Stats(stats) => {
                state.router.on_stats(worker, &stats);
                state.registry.on_stats(worker, stats);
            }
            WorkerMessage::Draining => {
                tracing::info!("worker {} is draining; routing no new requests to it", state.registry.label(worker));
                state.registry.set_draining(worker);
            }
            WorkerMessage::KvEvents(events) => {
                if state.router.apply_kv_events(worker, &events) == EventOutcome::NeedSnapshot {
                    tracing::warn!("KV event gap from {}; requesting a snapshot", state.registry.label(worker));
                    if let Some(w) = state.registry.get(worker) {
                        w.send(CoordinatorMessage::RequestKvSnapshot);
                    }
                }
            }
            WorkerMessage::ExportedKv { transfer, blocks, last } => {
                self.on_exported_kv(state, worker, transfer, blocks, last);
            }
            WorkerMessage::KvSnapshot { last_event_id, hashes, offloaded } => {
                state.router.apply_kv_snapshot(
                    worker,
                    last_event_id,
                    hashes.into_iter().map(|(hash, _)| hash),
                    offloaded,
                );
            }
        }
    }
}

/// Why a registered worker's stream ended, in words for the log: a worker
/// that drained says so when it closes.
fn departure(e: &transport::TransportError) -> String {
    use quinn::{ConnectionError, ReadError, ReadExactError};
    match e {
        transport::TransportError::Read(ReadExactError::ReadError(ReadError::ConnectionLost(
            ConnectionError::ApplicationClosed(close),
        ))) if close.reason.as_ref() == transport::DRAINED_CLOSE_REASON => {
            "drained (it finished its requests and closed the connection)".to_string()
        }
        other => other.to_string(),
    }
}
