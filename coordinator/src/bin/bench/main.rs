//! `tinyvllm-bench`: measures routing.
//!
//! - `workload`: an open-loop shared-prefix workload against a running
//!   cluster (see `loadgen`).
//! - `simulate`: the router's real policies over simulated workers (see
//!   `sim`), for cluster sizes we cannot run here.
//! - `agents`: coding-agent sessions re-sending their growing histories
//!   (see `agents`).

mod agents;
mod loadgen;
mod sim;

use clap::{Parser, Subcommand};
use coordinator::router::Policy;
use loadgen::WorkloadConfig;
use sim::SimConfig;

#[derive(Parser)]
#[command(name = "tinyvllm-bench", version, about = "tinyvllm routing benchmarks")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Shared-prefix workload with Poisson arrivals against a running coordinator.
    Workload {
        #[command(flatten)]
        cfg: WorkloadConfig,
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Coding-agent sessions, each re-sending its growing history every turn.
    Agents {
        #[command(flatten)]
        cfg: agents::AgentsConfig,
        /// Print one JSON object instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Route a synthetic Zipf workload over simulated workers with each policy.
    Simulate {
        #[arg(long, value_delimiter = ',', default_value = "64,256")]
        workers: Vec<usize>,
        #[command(flatten)]
        workload: SimWorkload,
        /// Policies to run (default: all four).
        #[arg(long, value_delimiter = ',')]
        policy: Vec<Policy>,
        #[arg(long)]
        json: bool,
    },
}

/// `simulate`'s workload: what it sets of `SimConfig`, for each cluster size it sweeps.
#[derive(clap::Args)]
struct SimWorkload {
    #[arg(long, default_value_t = 100_000)]
    requests: usize,
    #[arg(long, default_value_t = 2_000)]
    prefixes: usize,
    #[arg(long, default_value_t = 1.1)]
    zipf_s: f64,
    #[arg(long, default_value_t = 32)]
    prefix_blocks: usize,
    #[arg(long, default_value_t = 4)]
    suffix_blocks: usize,
    /// KV capacity per worker, in blocks.
    #[arg(long, default_value_t = 4_096)]
    kv_blocks: usize,
    #[arg(long, default_value_t = 0.8)]
    utilization: f64,
}

impl SimWorkload {
    fn config(&self, workers: usize) -> SimConfig {
        SimConfig {
            workers,
            requests: self.requests,
            prefixes: self.prefixes,
            zipf_s: self.zipf_s,
            prefix_blocks: self.prefix_blocks,
            suffix_blocks: self.suffix_blocks,
            kv_blocks: self.kv_blocks,
            utilization: self.utilization,
            ..SimConfig::default()
        }
    }
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Workload { cfg, json } => {
            anyhow::ensure!(
                cfg.rate > 0.0 && cfg.block_size > 0 && cfg.vocab_size > cfg.first_token,
                "invalid workload parameters"
            );
            let r = loadgen::run(&cfg);
            if json {
                println!("{}", r.to_json());
            } else {
                println!(
                    "workload: G={} P={} Q={} suffix={} R={}/s max_tokens={}",
                    cfg.groups, cfg.prefix_tokens, cfg.queries_per_group, cfg.suffix_tokens, cfg.rate, cfg.max_tokens
                );
                println!(
                    "requests {} (errors {}) in {:.1} s: {:.2} req/s, {:.1} output tok/s",
                    r.requests, r.errors, r.duration_s, r.requests_per_s, r.output_tok_per_s
                );
                println!(
                    "TTFT p50 {:.0} ms, p99 {:.0} ms, mean {:.0} ms; ITL p50 {:.1} ms, p99 {:.1} ms",
                    r.ttft_p50_ms, r.ttft_p99_ms, r.ttft_mean_ms, r.itl_p50_ms, r.itl_p99_ms
                );
                println!(
                    "prefix hit rate {:.1}% (best possible {:.1}%: {:.0}% of it)",
                    r.hit_rate * 100.0,
                    r.ideal_hit_rate * 100.0,
                    100.0 * r.hit_rate / r.ideal_hit_rate.max(1e-9)
                );
                for (worker, n) in &r.per_worker {
                    println!("  {worker}: {n} requests");
                }
            }
        }
        Command::Agents { cfg, json } => {
            anyhow::ensure!(cfg.vocab_size > cfg.first_token && cfg.turns > 0, "invalid session parameters");
            let r = agents::run(&cfg);
            if json {
                println!("{}", r.to_json());
            } else {
                println!(
                    "agents: {} sessions, {} tokens +{} a turn, {} turns{}",
                    cfg.sessions,
                    cfg.start_tokens,
                    cfg.turn_tokens,
                    cfg.turns,
                    if cfg.unique { ", unique histories" } else { "" }
                );
                println!(
                    "turns {} (errors {}) in {:.1} s: TTFT p50 {:.0} ms, p99 {:.0} ms, mean {:.0} ms (after the first turn {:.0} ms)",
                    r.turns, r.errors, r.duration_s, r.ttft_p50_ms, r.ttft_p99_ms, r.ttft_mean_ms, r.later_ttft_mean_ms
                );
                println!(
                    "{:.1} output tok/s, {:.0} prompt tok/s, {:.1}% of prompt tokens cached",
                    r.output_tok_per_s,
                    r.prompt_tok_per_s,
                    100.0 * r.cached_fraction
                );
            }
        }
        Command::Simulate { workers, workload, policy, json } => {
            let policies = if policy.is_empty() { Policy::ALL.to_vec() } else { policy };
            if !json {
                println!(
                    "{:>7} {:>13} {:>9} {:>9} {:>10} {:>12} {:>11} {:>11} {:>11}",
                    "workers",
                    "policy",
                    "hit rate",
                    "of ideal",
                    "imbalance",
                    "TTFT mean",
                    "TTFT p99",
                    "decide p50",
                    "decide p99"
                );
            }
            for &n in &workers {
                let cfg = workload.config(n);
                for &p in &policies {
                    let r = sim::simulate(&cfg, p);
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({
                                "workers": r.workers, "policy": r.policy.as_str(), "requests": r.requests,
                                "hit_rate": r.hit_rate, "ideal_hit_rate": r.ideal_hit_rate,
                                "load_imbalance": r.load_imbalance, "ttft_mean_ms": r.ttft_mean_ms,
                                "ttft_p99_ms": r.ttft_p99_ms, "decision_p50_us": r.decision_p50_us,
                                "decision_p99_us": r.decision_p99_us,
                            })
                        );
                    } else {
                        println!(
                            "{:>7} {:>13} {:>8.1}% {:>8.1}% {:>10.2} {:>9.0} ms {:>8.0} ms {:>8.1} µs {:>8.1} µs",
                            r.workers,
                            r.policy.as_str(),
                            r.hit_rate * 100.0,
                            100.0 * r.hit_rate / r.ideal_hit_rate.max(1e-9),
                            r.load_imbalance,
                            r.ttft_mean_ms,
                            r.ttft_p99_ms,
                            r.decision_p50_us,
                            r.decision_p99_us
                        );
                    }
                }
            }
        }
    }
    Ok(())
}
