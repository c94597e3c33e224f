//! What the coordinator says about itself and its cluster: `GET /v1/models`,
//! `GET /health`, `GET /v1/workers`, and `GET /v1/prometheus/targets`
//! (the workers' metrics endpoints for Prometheus service discovery).

use hyper::StatusCode;
use serde::Serialize;

use super::error::ApiError;
use super::reply::Reply;
use crate::app::AppState;
use crate::cluster::{PreparingInfo, WorkerInfo};

/// An OpenAI list object.
#[derive(Serialize)]
struct List<T> {
    object: &'static str,
    data: Vec<T>,
}

#[derive(Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    max_model_len: usize,
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    workers: usize,
    /// Workers offering themselves as stages (`--layers auto`) that no
    /// pipeline can be formed from yet, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pipeline_formation: Option<crate::cluster::FormationStatus>,
}

#[derive(Serialize)]
struct Workers {
    #[serde(flatten)]
    list: List<WorkerInfo>,
    /// Workers still downloading or loading their weights.
    preparing: Vec<PreparingInfo>,
    in_flight: usize,
    redispatches: u64,
}

/// A Prometheus `http_sd` target group. The endpoint needs the API key
/// when one is set (it lists workers' addresses).
#[derive(Serialize)]
struct TargetGroup<'a> {
    targets: [String; 1],
    labels: TargetLabels<'a>,
}

#[derive(Serialize)]
struct TargetLabels<'a> {
    worker: String,
    model_name: &'a str,
}

fn card(app: &AppState) -> ModelCard<'_> {
    ModelCard {
        id: &app.served_model_name,
        object: "model",
        created: app.started_at,
        owned_by: "tinyvllm",
        max_model_len: app.max_model_len(),
    }
}

/// `GET /v1/models`.
pub fn models(app: &AppState) -> Reply {
    Reply::json(&List { object: "list", data: vec![card(app)] })
}

/// `GET /v1/models/{id}` (the OpenAI client's `models.retrieve`): the card,
/// or OpenAI's 404 for a model this cluster does not serve.
pub fn model(app: &AppState, id: &str) -> Result<Reply, ApiError> {
    // Hub ids hold a slash, which a client may send encoded.
    let id = id.replace("%2F", "/").replace("%2f", "/");
    if id != app.served_model_name {
        return Err(ApiError::model_not_found(&id));
    }
    Ok(Reply::json(&card(app)))
}

/// `GET /health`: 200 only with at least one ready worker, and not while
/// the server drains for shutdown (load balancers stop sending then).
pub fn health(app: &AppState) -> Reply {
    let workers = app.cluster.workers().len();
    let pipeline_formation = app.cluster.formation_status();
    if app.shutting_down() {
        let body = Health { status: "draining", workers, pipeline_formation };
        return Reply::json_status(StatusCode::SERVICE_UNAVAILABLE, &body);
    }
    let ready = app.cluster.is_ready();
    let body = Health { status: if ready { "ok" } else { "no ready worker" }, workers, pipeline_formation };
    if ready { Reply::json(&body) } else { Reply::json_status(StatusCode::SERVICE_UNAVAILABLE, &body) }
}

/// `GET /v1/workers`.
pub fn workers(app: &AppState) -> Reply {
    Reply::json(&Workers {
        list: List { object: "list", data: app.cluster.workers() },
        preparing: app.cluster.preparing(),
        in_flight: app.cluster.in_flight(),
        redispatches: app.cluster.redispatches(),
    })
}

/// `GET /v1/prometheus/targets`: the workers' metrics endpoints in
/// Prometheus `http_sd` format, so a scrape config needs no edit when
/// workers come and go.
pub fn prometheus_targets(app: &AppState) -> Reply {
    // A pipeline's later stages serve metrics of their own (its first
    // stage is the worker itself).
    let groups: Vec<TargetGroup<'_>> = app
        .cluster
        .workers()
        .into_iter()
        .flat_map(|w| {
            let later = w.stages.into_iter().skip(1).map(|s| (s.metrics_address, s.name));
            std::iter::once((w.metrics_address, w.name)).chain(later)
        })
        .filter_map(|(target, worker)| {
            Some(TargetGroup {
                targets: [target?],
                labels: TargetLabels { worker, model_name: &app.served_model_name },
            })
        })
        .collect();
    Reply::json(&groups)
}
