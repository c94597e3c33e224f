//! Everything a request handler needs, shared behind an `Arc`: the cluster,
//! the tokenizer and chat template (with its tool-call format), the HTTP
//! limits, the blocking pool that parsing and tokenizing run on, and the
//! shutdown state.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use common::structured::GrammarCompiler;
use tokio::sync::{Semaphore, watch};

use crate::api::ApiError;
use crate::cluster::Cluster;
use crate::metrics::Metrics;
use crate::text::{ChatTemplate, Tokenizer};
use crate::tool_parser::ToolFormat;

/// Bodies up to this size are parsed and tokenized without waiting for a
/// pool permit: they take milliseconds, and must never queue behind a
/// multi-megabyte prompt.
pub const SMALL_BODY_BYTES: usize = 64 << 10;

/// What the HTTP server allows a client.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// Largest accepted request body, in bytes.
    pub max_body_bytes: usize,
    /// A request head must arrive whole within this.
    pub header_timeout: Duration,
    /// A request body must arrive whole within this.
    pub body_timeout: Duration,
    /// Open connections at most; idle ones are closed to make room.
    pub max_connections: usize,
    /// Large requests parsed and tokenized at once (each on a blocking thread).
    pub tokenizer_pool: usize,
    /// Choices one request may ask for (prompts × n): more could never be
    /// in flight at once.
    pub max_choices: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 1024,
            tokenizer_pool: 1,
            max_choices: 1024,
        }
    }
}

pub struct AppState {
    pub cluster: Cluster,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    /// How the model writes tool calls: detected from its chat template, or
    /// `--tool-call-parser`; `None` serves only `tool_choice: "none"`.
    pub tool_format: Option<ToolFormat>,
    /// `--max-tokens-cap`: no request generates more tokens than this
    /// (llama.cpp server's `--n-predict`), whatever its `max_tokens` says.
    pub max_tokens_cap: Option<u32>,
    /// A structured output covers the thinking too (vLLM's
    /// `structured_outputs_config.enable_in_reasoning`); by default it
    /// applies once the thinking ends.
    pub constrain_reasoning: bool,
    /// `--reasoning-parser`: how the model's thinking is split from its answer.
    pub reasoning_format: Option<crate::reasoning::ReasoningFormat>,
    /// `/v1/responses` kept for `previous_response_id` and `GET`.
    pub responses: crate::api::responses::ResponseStore,
    /// Answers kept for retries with an `Idempotency-Key`.
    pub idempotency: crate::idempotency::IdempotencyStore,
    pub served_model_name: String,
    /// The model's context (or `--max-model-len`); see [`AppState::max_model_len`].
    model_max_len: usize,
    /// Tokens per KV block, to turn workers' cache sizes into tokens.
    block_size: usize,
    /// The most bytes of text one token covers, with slack (see `text_can_fit`).
    max_bytes_per_token: usize,
    pub api_key: Option<String>,
    pub limits: HttpLimits,
    pub started_at: u64,
    pub metrics: Metrics,
    /// Compiles structured-output constraints to check them before
    /// dispatch; `Err` says why this model takes none.
    grammar_compiler: Result<Arc<GrammarCompiler>, String>,
    pool: Arc<Semaphore>,
    shutting_down: AtomicBool,
    /// Turns true when in-flight responses must end (the shutdown timeout).
    cut: watch::Sender<bool>,
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
        block_size: usize,
        api_key: Option<String>,
        limits: HttpLimits,
    ) -> Self {
        let started_at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Self {
            metrics: Metrics::new(cluster.routing_metrics()),
            cluster,
            max_bytes_per_token: max_bytes_per_token(&tokenizer),
            tokenizer,
            tool_format: chat_template.as_ref().and_then(|t| ToolFormat::detect(t.source())),
            max_tokens_cap: None,
            constrain_reasoning: false,
            reasoning_format: None,
            responses: Default::default(),
            idempotency: crate::idempotency::IdempotencyStore::in_memory(),
            chat_template,
            served_model_name,
            model_max_len: max_model_len,
            block_size,
            api_key,
            pool: Arc::new(Semaphore::new(limits.tokenizer_pool.max(1))),
            limits,
            started_at,
            grammar_compiler: Err("structured outputs are not set up on this coordinator".into()),
            shutting_down: AtomicBool::new(false),
            cut: watch::Sender::new(false),
            next_id: AtomicU64::new(started_at << 20),
        }
    }

    /// With structured outputs checked by `compiler` (see `api::structured`).
    pub fn with_grammar_compiler(mut self, compiler: Result<Arc<GrammarCompiler>, String>) -> Self {
        self.grammar_compiler = compiler;
        self
    }

    /// What compiles structured-output constraints; `Err` says why there is none.
    pub fn grammar_compiler(&self) -> Result<&GrammarCompiler, &str> {
        self.grammar_compiler.as_deref().map_err(String::as_str)
    }

    /// The effective context: the model's, or the smallest worker KV cache
    /// if that holds fewer tokens. A request that fits it never ends early
    /// for want of cache (the worker caps requests at its cache the same way).
    pub fn max_model_len(&self) -> usize {
        let cache = self
            .cluster
            .workers()
            .iter()
            .map(|w| w.stats.kv_blocks_total as usize * self.block_size)
            .filter(|&tokens| tokens > 0)
            .min();
        cache.map_or(self.model_max_len, |c| c.min(self.model_max_len))
    }

    /// Whether `bytes` of text could tokenize to fewer than `max_len` tokens;
    /// false means it cannot, and is refused without tokenizing it.
    pub fn text_can_fit(&self, bytes: usize, max_len: usize) -> bool {
        bytes <= max_len.saturating_mul(self.max_bytes_per_token)
    }

    /// Runs `f` (parsing, templating, tokenizing) on a blocking thread, off
    /// the async runtime, so a huge prompt delays nobody else. Work for a
    /// body over [`SMALL_BODY_BYTES`] first waits for one of the pool's
    /// permits: at most `tokenizer_pool` of those run at once.
    pub async fn offload<T, F>(self: &Arc<Self>, body_bytes: usize, f: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
    {
        let permit = if body_bytes > SMALL_BODY_BYTES {
            Some(self.pool.clone().acquire_owned().await.map_err(|_| ApiError::internal("the tokenizer pool closed"))?)
        } else {
            None
        };
        let app = self.clone();
        let joined = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            f(&app)
        })
        .await;
        joined.unwrap_or_else(|e| Err(ApiError::internal(format!("preparing the request failed: {e}"))))
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

    /// Ends every response still running: streams with an error event (and
    /// `[DONE]`), whole responses with a 503.
    pub fn cut_responses(&self) {
        self.cut.send_replace(true);
    }

    /// Resolves once [`AppState::cut_responses`] was called.
    pub fn cut(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            let _ = rx.wait_for(|&cut| cut).await;
        }
    }
}

/// UTF-8 text can shrink in a tokenizer's normalizer (NFKC folds a 3-byte
/// character into 1 byte; no character shrinks below 1 byte), so a token
/// may cover up to this many times its own bytes of the request's text.
const NORMALIZER_SLACK: usize = 4;

/// The longest token's text in bytes, times [`NORMALIZER_SLACK`]. A token's
/// text is never shorter than the input bytes it stands for (byte-level
/// BPE spells each byte with a 1-2 byte character; `<0xHH>` pieces are 6
/// bytes for 1), so `bytes / this` bounds a text's token count from below.
fn max_bytes_per_token(tokenizer: &Tokenizer) -> usize {
    let longest = (0..tokenizer.vocab_size() as u32).map(|id| tokenizer.token_piece(id).len()).max().unwrap_or(1);
    longest.max(1) * NORMALIZER_SLACK
}
