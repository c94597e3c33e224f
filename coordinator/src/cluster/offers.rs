//! Workers started with `--layers auto` offer themselves before loading
//! any weights (issue 30): their memory, the model's size at their dtype,
//! and where they would listen as a later stage. The coordinator holds the
//! offers, asks the planner (`plan`) what can be formed whenever one comes
//! or goes, and answers each worker of a formed replica or pipeline with
//! its layers and the next stage's address. The workers then load their
//! layers and link up exactly as pinned stages do; stage 0 registers with
//! the normal handshake, so a formed pipeline is one routing target.
//!
//! While nothing can be formed, every waiting worker, the log and
//! `GET /health` say what is missing; a request meanwhile gets the usual
//! 503 (no worker), with the same words.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::protocol::{OfferReply, StageAssignment, StageOffer};
use common::transport;
use serde::Serialize;
use tokio::sync::mpsc;

use super::Cluster;
use super::plan::{self, OfferedMemory, Plan, Shortfall};

/// The offers not yet formed into anything, and what the planner needs.
#[derive(Default)]
pub(super) struct Formation {
    /// `--pipeline-parallel-size` when over 1.
    pipeline_size: Option<usize>,
    /// Each decoder layer's parameters: what stages split.
    layer_weights: Vec<u64>,
    pending: BTreeMap<u64, Pending>,
    next_offer: u64,
    /// What the planner last said while offers were waiting.
    shortfall: Option<String>,
}

struct Pending {
    name: String,
    memory: OfferedMemory,
    /// Where the stage before may dial it.
    stage_address: SocketAddr,
    replies: mpsc::UnboundedSender<OfferReply>,
}

/// What `GET /health` shows of the waiting offers.
#[derive(Clone, Debug, Serialize)]
pub struct FormationStatus {
    /// Why no replica or pipeline can be formed from them yet.
    pub problem: String,
    /// The waiting workers, with the memory each offers.
    pub offers: Vec<OfferInfo>,
}

#[derive(Clone, Debug, Serialize)]
pub struct OfferInfo {
    pub name: String,
    pub memory_bytes: u64,
}

impl Cluster {
    /// Plans pipelines from offers for a model whose layers weigh
    /// `layer_weights` (parameters each), of `pipeline_size` stages each
    /// when that is over 1 (else as memory needs).
    pub fn with_formation(self, layer_weights: Vec<u64>, pipeline_size: usize) -> Self {
        {
            let mut formation = self.formation();
            formation.layer_weights = layer_weights;
            formation.pipeline_size = (pipeline_size > 1).then_some(pipeline_size);
        }
        self
    }

    fn formation(&self) -> std::sync::MutexGuard<'_, Formation> {
        self.formation.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The waiting offers and why they wait; `None` when none waits.
    pub fn formation_status(&self) -> Option<FormationStatus> {
        let formation = self.formation();
        let problem = formation.shortfall.clone().filter(|_| !formation.pending.is_empty())?;
        let offers = formation
            .pending
            .values()
            .map(|p| OfferInfo { name: p.name.clone(), memory_bytes: p.memory.memory })
            .collect();
        Some(FormationStatus { problem, offers })
    }

    /// Holds an authenticated offer until it is assigned (then the worker
    /// goes on by itself) or its connection ends (then it is withdrawn).
    pub(super) async fn serve_offer(
        &self,
        conn: quinn::Connection,
        offer: StageOffer,
        mut send: quinn::SendStream,
    ) -> Result<(), String> {
        self.accept_proving_the_secret(&conn, &mut send).await?;
        let mut stage_address = offer.stage_listen;
        if stage_address.ip().is_unspecified() {
            stage_address.set_ip(conn.remote_address().ip());
        }
        let (tx, mut replies) = mpsc::unbounded_channel();
        let id = {
            let mut formation = self.formation();
            let id = formation.next_offer;
            formation.next_offer += 1;
            let memory = OfferedMemory { memory: offer.memory_bytes, model_weight_bytes: offer.model_weight_bytes };
            tracing::info!(
                "worker {:?} offers {} of memory (the model's weights are {} on it; {}); stage address {stage_address}",
                offer.worker_name,
                plan::bytes(memory.memory),
                plan::bytes(memory.model_weight_bytes),
                offer.device
            );
            formation.pending.insert(id, Pending { name: offer.worker_name, memory, stage_address, replies: tx });
            id
        };
        self.form();
        loop {
            tokio::select! {
                reply = replies.recv() => {
                    let Some(reply) = reply else { break };
                    let assigned = matches!(reply, OfferReply::Assigned(_));
                    if let Err(e) = transport::write_frame(&mut send, &reply).await {
                        self.withdraw(id);
                        return Err(format!("offer lost: {e}"));
                    }
                    if assigned {
                        // Let the assignment arrive; the worker closes.
                        let _ = send.finish();
                        let _ = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
                        return Ok(());
                    }
                }
                closed = conn.closed() => {
                    self.withdraw(id);
                    return Err(format!("offer withdrawn: {closed}"));
                }
            }
        }
        Ok(())
    }

    fn withdraw(&self, id: u64) {
        let removed = self.formation().pending.remove(&id);
        if removed.is_some() {
            self.form();
        }
    }

    /// Forms whatever the waiting offers allow, then tells those still
    /// waiting why (when that changed).
    fn form(&self) {
        let mut guard = self.formation();
        let formation = &mut *guard;
        loop {
            let ids: Vec<u64> = formation.pending.keys().copied().collect();
            let memory: Vec<OfferedMemory> = formation.pending.values().map(|p| p.memory).collect();
            let stages = match plan::plan(&memory, &formation.layer_weights, formation.pipeline_size) {
                Plan::Replica(i) => vec![(i, common::pipeline::LayerRange::full(formation.layer_weights.len()))],
                Plan::Pipeline(stages) => stages,
                Plan::Wait(why) => {
                    let why = (why != Shortfall::NoOffers).then(|| why.to_string());
                    if why.is_some() && why != formation.shortfall {
                        tracing::warn!("cannot form a pipeline yet: {}", why.as_deref().unwrap_or_default());
                        for p in formation.pending.values() {
                            let _ = p.replies.send(OfferReply::Waiting { why: why.clone().unwrap_or_default() });
                        }
                    }
                    formation.shortfall = why;
                    return;
                }
            };
            let members: Vec<(Pending, common::pipeline::LayerRange)> = stages
                .into_iter()
                .filter_map(|(i, layers)| Some((formation.pending.remove(&ids[i])?, layers)))
                .collect();
            assign(&members);
        }
    }
}

/// Sends each member its layers and the next member's address.
fn assign(members: &[(Pending, common::pipeline::LayerRange)]) {
    let Some((first, _)) = members.first() else { return };
    let pipeline = first.name.clone();
    if members.len() == 1 {
        tracing::info!("worker {pipeline:?} holds the whole model: a replica");
    } else {
        let shown: Vec<String> = members
            .iter()
            .map(|(p, l)| format!("{} layers {l} ({} of memory)", p.name, plan::bytes(p.memory.memory)))
            .collect();
        tracing::info!("formed pipeline {pipeline:?} of {} stages: {}", members.len(), shown.join(", "));
    }
    for (k, (member, layers)) in members.iter().enumerate() {
        let next_stage = members.get(k + 1).map(|(next, _)| next.stage_address.to_string());
        let _ = member.replies.send(OfferReply::Assigned(StageAssignment {
            pipeline: pipeline.clone(),
            stage: k as u32,
            stages: members.len() as u32,
            layers: *layers,
            next_stage,
        }));
    }
}
