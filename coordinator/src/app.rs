//! Everything a request handler needs, shared behind an `Arc`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::cluster::Cluster;
use crate::metrics::Metrics;
use crate::text::{ChatTemplate, Tokenizer};

pub struct AppState {
    pub cluster: Cluster,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub served_model_name: String,
    pub max_model_len: usize,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    pub started_at: u64,
    pub metrics: Metrics,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
}

impl AppState {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cluster: Cluster,
        tokenizer: Arc<Tokenizer>,
        chat_template: Option<ChatTemplate>,
        served_model_name: String,
        max_model_len: usize,
        api_key: Option<String>,
        max_body_bytes: usize,
    ) -> Self {
        let started_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Self {
            metrics: Metrics::new(cluster.routing_metrics()),
            cluster,
            tokenizer,
            chat_template,
            served_model_name,
            max_model_len,
            api_key,
            max_body_bytes,
            started_at,
            shutting_down: AtomicBool::new(false),
            next_id: AtomicU64::new(started_at << 20),
        }
    }

    /// A unique suffix for response ids.
    pub fn next_id(&self) -> String {
        format!("{:x}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    pub fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }
}
