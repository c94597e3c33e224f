//! Fuzz target: HTTP request parsing and validation. The input is a
//! request body, sent to each generating endpoint's handler (`/generate`,
//! `/v1/completions`, `/v1/chat/completions`) of a real coordinator state
//! with tiny-qwen3's tokenizer and chat template and no workers: a body that
//! passes every check reaches the cluster and gets 503 (no worker), so the
//! whole of parsing, tokenization, templating and validation runs.
//!
//! Invariants: no panic; the answer is an error (never a 2xx without a
//! worker) whose status is a 4xx or, for a valid request, 503; its body is
//! OpenAI's JSON error shape with a message.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use common::protocol::ModelIdentity;
use http_body_util::BodyExt;
use hyper::StatusCode;

use super::{MODELS, fixtures};
use crate::api::{ApiError, Reply, chat, completions, generate};
use crate::app::{AppState, HttpLimits};
use crate::cluster::Cluster;
use crate::text::ChatTemplate;

/// Served under this name; a request naming another model gets 404.
pub const MODEL_NAME: &str = "tiny-qwen3";
/// tiny-qwen3's `max_position_embeddings`.
const MAX_MODEL_LEN: usize = 1024;

type Handler = fn(Arc<AppState>, &[u8]) -> Pin<Box<dyn Future<Output = Result<Reply, ApiError>> + Send + '_>>;

const ENDPOINTS: [(&str, Handler); 3] = [
    ("/generate", |app, body| Box::pin(generate::generate(app, Bytes::copy_from_slice(body)))),
    ("/v1/completions", |app, body| Box::pin(completions::completions(app, Bytes::copy_from_slice(body)))),
    ("/v1/chat/completions", |app, body| Box::pin(chat::chat(app, Bytes::copy_from_slice(body)))),
];

struct Server {
    runtime: tokio::runtime::Runtime,
    app: Arc<AppState>,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a tokio runtime");
        let tokenizer = fixtures().tokenizers[MODELS.len() - 1].clone();
        let template = ChatTemplate::from_tokenizer(&tokenizer).expect("tiny-qwen3's template compiles");
        let identity = ModelIdentity { name: MODEL_NAME.into(), config_hash: 0 };
        let cluster = Cluster::new("fuzz".into(), identity, 64, Default::default(), 16);
        let app = AppState::new(
            cluster,
            tokenizer,
            template,
            MODEL_NAME.into(),
            MAX_MODEL_LEN,
            16,
            None,
            HttpLimits::default(),
        );
        Server { runtime, app: Arc::new(app) }
    })
}

/// Sends `body` to every generating endpoint.
pub fn http_request(body: &[u8]) {
    let server = server();
    for (path, handler) in ENDPOINTS {
        let result = server.runtime.block_on(handler(server.app.clone(), body));
        let error = match result {
            Ok(reply) => panic!("{path}: {} without a worker", reply.status()),
            Err(e) => e,
        };
        let status = error.status;
        assert!(
            status.is_client_error() || status == StatusCode::SERVICE_UNAVAILABLE,
            "{path}: status {status} for {:?}",
            error.message
        );
        assert!(!error.message.is_empty(), "{path}: an error without a message");
        let response = Reply::error(&error).into_response();
        let bytes = server
            .runtime
            .block_on(response.into_body().collect())
            .map(|collected| collected.to_bytes())
            .unwrap_or_default();
        let json: serde_json::Value = serde_json::from_slice(&bytes).expect("the error body is JSON");
        assert!(json["error"]["message"].is_string(), "{path}: error body {json}");
        assert!(json["error"]["type"].is_string(), "{path}: error body {json}");
    }
}
