//! `tinyvllm-worker serve --layers auto`: before loading any weights, the
//! worker offers itself to the coordinator (its memory, the model's size
//! at its dtype, where it would listen as a later stage) and waits for
//! the layers it is assigned (issue 30; the coordinator's side is
//! `coordinator::cluster::offers`). Then `serve` goes on as if those
//! layers and the next stage's address had been given on the command line.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use common::protocol::{OfferReply, PROTOCOL_VERSION, StageAssignment, StageOffer, WorkerHello};
use common::transport::{self, Role};

use super::engine_args::Resolved;

/// What the offer says besides the worker's name and secret.
pub struct Offer {
    pub memory_bytes: u64,
    pub model_weight_bytes: u64,
    pub stage_listen: SocketAddr,
    pub block_size: usize,
}

/// Bytes the whole model's weights take on this worker: a GGUF file's
/// size, else the parameters at the load dtype (or the `--quantize`
/// format's bits per weight).
pub fn model_weight_bytes(resolved: &Resolved, quantize: Option<worker::Quantization>) -> u64 {
    if let Some(size) = resolved.files.gguf.as_ref().and_then(|g| std::fs::metadata(g).ok()).map(|m| m.len()) {
        return size;
    }
    let params = resolved.files.config.parameter_count();
    let tenths_of_bits = match quantize {
        Some(worker::Quantization::Q8_0) => 85,
        Some(worker::Quantization::Q4_0) => 45,
        _ => 80 * resolved.dtype.size_in_bytes() as u64,
    };
    params * tenths_of_bits / 80
}

/// A concrete address to listen on: port 0 is replaced by a free port now,
/// since the coordinator must hand the address to the stage before before
/// this worker listens.
pub fn concrete_listen_address(listen: SocketAddr) -> anyhow::Result<SocketAddr> {
    if listen.port() != 0 {
        return Ok(listen);
    }
    let socket = std::net::UdpSocket::bind(listen).with_context(|| format!("--stage-listen {listen}"))?;
    Ok(SocketAddr::new(listen.ip(), socket.local_addr()?.port()))
}

/// Offers this worker until the coordinator assigns it layers, dialling
/// again if the connection drops; `None` on SIGTERM meanwhile.
pub async fn await_assignment(
    coordinator: &str,
    name: &str,
    secret: &str,
    resolved: &Resolved,
    offer: Offer,
) -> anyhow::Result<Option<StageAssignment>> {
    let address = tokio::net::lookup_host(coordinator)
        .await
        .ok()
        .and_then(|mut a| a.next())
        .with_context(|| format!("--coordinator {coordinator}: not a HOST:PORT this machine can resolve"))?;
    let endpoint = transport::client_endpoint(address)?;
    let stage_offer = |binding: &[u8; 32]| StageOffer {
        protocol_version: PROTOCOL_VERSION,
        worker_name: name.to_string(),
        model: resolved.files.identity(),
        block_size: offer.block_size as u32,
        memory_bytes: offer.memory_bytes,
        model_weight_bytes: offer.model_weight_bytes,
        stage_listen: offer.stage_listen,
        device: resolved.description.clone(),
        auth_tag: transport::auth_tag(secret.as_bytes(), Role::Worker, binding),
    };
    tracing::info!(
        "offering {} bytes of memory to the coordinator at {address} (the model's weights take {} bytes here)",
        offer.memory_bytes,
        offer.model_weight_bytes
    );
    let mut backoff = Duration::from_millis(200);
    loop {
        let attempt = tokio::select! {
            attempt = offer_once(&endpoint, address, secret, &stage_offer) => attempt,
            () = transport::shutdown_signal() => return Ok(None),
        };
        match attempt {
            Ok(assignment) => {
                endpoint.close(0u32.into(), b"assigned");
                return Ok(Some(assignment));
            }
            Err(Attempt::Fatal(e)) => return Err(e),
            Err(Attempt::Retry(why)) => {
                tracing::warn!("offering to the coordinator at {address}: {why}; again in {backoff:?}");
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

enum Attempt {
    /// Refused, or the coordinator could not prove the secret: retrying cannot help.
    Fatal(anyhow::Error),
    Retry(String),
}

async fn offer_once(
    endpoint: &quinn::Endpoint,
    address: SocketAddr,
    secret: &str,
    stage_offer: &impl Fn(&[u8; 32]) -> StageOffer,
) -> Result<StageAssignment, Attempt> {
    let retry = |e: &dyn std::fmt::Display| Attempt::Retry(e.to_string());
    let conn =
        endpoint.connect(address, transport::SERVER_NAME).map_err(|e| retry(&e))?.await.map_err(|e| retry(&e))?;
    let binding = transport::channel_binding(&conn).map_err(|e| retry(&e))?;
    let (mut send, mut recv) = conn.open_bi().await.map_err(|e| retry(&e))?;
    transport::write_frame(&mut send, &WorkerHello::Offer(stage_offer(&binding))).await.map_err(|e| retry(&e))?;
    let mut authenticated = false;
    loop {
        let reply = transport::read_frame::<OfferReply>(&mut recv).await.map_err(|e| retry(&e))?;
        if !authenticated && matches!(reply, Some(OfferReply::Waiting { .. } | OfferReply::Assigned(_))) {
            return Err(Attempt::Fatal(anyhow::anyhow!("the coordinator answered before proving the cluster secret")));
        }
        match reply {
            Some(OfferReply::Accepted { auth_tag }) => {
                if !transport::verify_auth_tag(secret.as_bytes(), Role::Coordinator, &binding, &auth_tag) {
                    return Err(Attempt::Fatal(anyhow::anyhow!("the coordinator could not prove the cluster secret")));
                }
                transport::trust_connection(&conn);
                authenticated = true;
            }
            Some(OfferReply::Waiting { why }) => tracing::info!("waiting for a pipeline to be formed: {why}"),
            Some(OfferReply::Assigned(assignment)) => {
                conn.close(0u32.into(), b"assigned");
                return Ok(assignment);
            }
            Some(OfferReply::Refused { reason }) => {
                return Err(Attempt::Fatal(anyhow::anyhow!("the coordinator refused this worker: {reason}")));
            }
            None => return Err(Attempt::Retry("the coordinator closed the offer".into())),
        }
    }
}
