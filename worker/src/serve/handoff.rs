//! KV blocks for peers: an `ExportKv`'s blocks in frames, and a draining
//! worker's handoff of its cache (sent before it exits, confirmed by the
//! coordinator before it closes its connection).

use std::time::Duration;

use common::protocol::{CoordinatorMessage, WorkerMessage};
use common::transport;
use tokio::sync::mpsc;

use crate::engine::Engine;

/// Waits (a while) for the coordinator to say a handoff was passed on: the
/// connection's close would drop frames still in flight.
pub(super) async fn await_handoff(
    frames: &mut mpsc::Receiver<Result<Option<CoordinatorMessage>, transport::TransportError>>,
) {
    let acked = async {
        while let Some(Ok(Some(frame))) = frames.recv().await {
            if matches!(frame, CoordinatorMessage::HandedOff) {
                return;
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(10), acked).await.is_err() {
        tracing::warn!("draining: the coordinator did not confirm the KV handoff");
    }
}

/// Most bytes of blocks a draining worker hands off (they are copied into
/// frames at once: this bounds the memory the handoff adds).
const HANDOFF_BYTES: usize = 1 << 30;

/// A draining worker with a second tier sends its cached blocks before it
/// exits (`KV_HANDOFF`): the coordinator passes them to a peer that keeps
/// them, so its sessions' next turns find their history there.
pub(super) fn hand_off(engine: &mut Engine, out: &mpsc::UnboundedSender<WorkerMessage>) {
    if !engine.takes_kv_imports() {
        return;
    }
    match engine.export_all_kv_blocks(HANDOFF_BYTES) {
        Ok(blocks) => {
            tracing::info!(blocks = blocks.len(), "draining: handing the KV cache's blocks to a peer");
            for frame in export_frames(common::protocol::KV_HANDOFF, blocks) {
                let _ = out.send(frame);
            }
        }
        Err(e) => tracing::warn!("draining: the KV handoff failed: {e}"),
    }
}

/// A peer's blocks in frames of at most `KV_EXPORT_FRAME_BYTES`, the last
/// marked (one empty frame when there are none).
pub(super) fn export_frames(transfer: u64, blocks: Vec<common::protocol::KvBlock>) -> Vec<WorkerMessage> {
    let mut frames = Vec::new();
    let (mut current, mut bytes) = (Vec::new(), 0);
    for block in blocks {
        if bytes + block.bytes.len() > common::protocol::KV_EXPORT_FRAME_BYTES && !current.is_empty() {
            frames.push(WorkerMessage::ExportedKv { transfer, blocks: std::mem::take(&mut current), last: false });
            bytes = 0;
        }
        bytes += block.bytes.len();
        current.push(block);
    }
    frames.push(WorkerMessage::ExportedKv { transfer, blocks: current, last: true });
    frames
}
