//! The prefix cache's second tier in Prometheus: vLLM's names where it has
//! them (`vllm:external_prefix_cache_*`, which its KV connectors count in
//! tokens), ours (`tinyvllm_kv_tier_*`) for the blocks, bytes and seconds
//! moved, and the faults (failed writes, damaged files).

use engine_core::TierStats;
use prometheus::{Counter, Gauge, IntCounter, IntCounterVec, Opts, Registry, core::Collector};

use crate::tier::StoreStats;

pub struct TierMetrics {
    queries: IntCounter,
    hits: IntCounter,
    blocks: Gauge,
    offloaded: IntCounter,
    restored: IntCounter,
    bytes: IntCounterVec,
    seconds: prometheus::CounterVec,
    write_failures: IntCounter,
    damaged: IntCounter,
    dropped: IntCounter,
    last: (TierStats, StoreStats),
}

impl TierMetrics {
    pub fn new(registry: &Registry) -> Self {
        let counter = |name: &str, help: &str| IntCounter::new(name, help).expect("valid metric");
        let m = Self {
            queries: counter(
                "vllm:external_prefix_cache_queries_total",
                "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens.",
            ),
            hits: counter(
                "vllm:external_prefix_cache_hits_total",
                "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
            ),
            blocks: Gauge::new("tinyvllm_kv_tier_blocks", "Blocks the prefix cache's second tier holds.")
                .expect("valid metric"),
            offloaded: counter("tinyvllm_kv_tier_offloaded_blocks_total", "Evicted blocks kept in the second tier."),
            restored: counter(
                "tinyvllm_kv_tier_restored_blocks_total",
                "Blocks copied back from the second tier instead of recomputed.",
            ),
            bytes: IntCounterVec::new(
                Opts::new("tinyvllm_kv_tier_bytes_total", "Bytes the second tier moved, by direction."),
                &["direction"],
            )
            .expect("valid metric"),
            seconds: prometheus::CounterVec::new(
                Opts::new("tinyvllm_kv_tier_seconds_total", "Step time spent copying blocks to and from the tier."),
                &["direction"],
            )
            .expect("valid metric"),
            write_failures: counter(
                "tinyvllm_kv_tier_write_failures_total",
                "Blocks whose write to the tier's disk failed (a full or failing disk): evicted instead.",
            ),
            damaged: counter(
                "tinyvllm_kv_tier_damaged_blocks_total",
                "Block files refused by their checksum or length, deleted and recomputed.",
            ),
            dropped: counter("tinyvllm_kv_tier_dropped_blocks_total", "Blocks the tier dropped (for room, or lost)."),
            last: Default::default(),
        };
        let collectors: Vec<Box<dyn Collector>> = vec![
            Box::new(m.queries.clone()),
            Box::new(m.hits.clone()),
            Box::new(m.blocks.clone()),
            Box::new(m.offloaded.clone()),
            Box::new(m.restored.clone()),
            Box::new(m.bytes.clone()),
            Box::new(m.seconds.clone()),
            Box::new(m.write_failures.clone()),
            Box::new(m.damaged.clone()),
            Box::new(m.dropped.clone()),
        ];
        for c in collectors {
            registry.register(c).expect("unique metric names");
        }
        for direction in ["offload", "restore", "disk_write", "disk_read"] {
            m.bytes.with_label_values(&[direction]);
        }
        for direction in ["offload", "restore"] {
            m.seconds.with_label_values(&[direction]);
        }
        m
    }

    /// The engine core's counters and the store's, as increments.
    pub fn observe(&mut self, tier: &TierStats, store: Option<StoreStats>) {
        let store = store.unwrap_or_default();
        let (t, s) = (&self.last.0, &self.last.1);
        self.queries.inc_by(tier.queried_tokens.saturating_sub(t.queried_tokens));
        self.hits.inc_by(tier.hit_tokens.saturating_sub(t.hit_tokens));
        self.blocks.set(tier.blocks as f64);
        self.offloaded.inc_by(tier.offloaded.saturating_sub(t.offloaded));
        self.restored.inc_by(tier.restored.saturating_sub(t.restored));
        self.dropped.inc_by(tier.dropped.saturating_sub(t.dropped));
        for (direction, now, before) in [
            ("offload", store.bytes_offloaded, s.bytes_offloaded),
            ("restore", store.bytes_restored, s.bytes_restored),
            ("disk_write", store.bytes_written, s.bytes_written),
            ("disk_read", store.bytes_loaded, s.bytes_loaded),
        ] {
            self.bytes.with_label_values(&[direction]).inc_by(now.saturating_sub(before));
        }
        let seconds = |c: &Counter, now: f64, before: f64| c.inc_by((now - before).max(0.0));
        seconds(&self.seconds.with_label_values(&["offload"]), store.offload_seconds, s.offload_seconds);
        seconds(&self.seconds.with_label_values(&["restore"]), store.restore_seconds, s.restore_seconds);
        self.write_failures.inc_by(store.write_failures.saturating_sub(s.write_failures));
        self.damaged.inc_by(store.damaged.saturating_sub(s.damaged));
        self.last = (*tier, store);
    }
}
