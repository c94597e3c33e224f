//! The prefix cache's second tier against recomputation (issue 60): every
//! golden case of every model, run once and then again in a KV cache that
//! holds only the longest case, so the second round's prefixes were
//! evicted and come back from the tier (host memory, or a directory on
//! disk read by a new engine, as after a restart) instead of being
//! recomputed, and must give transformers' tokens all the same; f16 and
//! q8_0 caches against their own recomputation; the Metal step plan's
//! pools (emulated); and the faults: damaged and truncated files, a disk
//! that fills mid-write, and files of another model or format.

mod support;

use std::path::{Path, PathBuf};

use common::{RequestId, SamplingParams};
use kernels::KvCacheDtype;
use serde::Deserialize;
use support::test_data;
use worker::models::{ModelFiles, ModelSource, Need};
use worker::tier::TierConfig;
use worker::{Engine, EngineConfig};

#[derive(Deserialize)]
struct Golden {
    model: String,
    cases: Vec<Case>,
}

#[derive(Deserialize, Clone)]
struct Case {
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
}

const GOLDEN: &[&str] = &[
    "stories260K.json",
    "tiny-qwen3.json",
    "tiny-qwen3-chat.json",
    "tiny-qwen3-yarn.json",
    "tiny-qwen2.json",
    "tiny-llama3.json",
    "tiny-mistral.json",
    "tiny-mixtral.json",
    "tiny-qwen3-moe.json",
    "tiny-glm4-moe.json",
    "tiny-gpt-oss.json",
    "tiny-gemma3.json",
];

fn load_golden(file: &str) -> Golden {
    let path = test_data().join("golden").join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

struct Setup {
    tier: TierConfig,
    kv_cache_dtype: Option<KvCacheDtype>,
    on_plan: bool,
}

const IN_MEMORY: u64 = 256 << 20;

fn memory_tier() -> Setup {
    Setup { tier: TierConfig { bytes: IN_MEMORY, dir: None }, kv_cache_dtype: None, on_plan: false }
}

fn disk_tier(dir: &Path) -> Setup {
    Setup { tier: TierConfig { bytes: IN_MEMORY, dir: Some(dir.to_path_buf()) }, ..memory_tier() }
}

fn no_tier() -> Setup {
    Setup { tier: TierConfig::default(), ..memory_tier() }
}

/// Blocks for the longest case and two more: every other case evicts it.
fn small_pool(cases: &[Case]) -> usize {
    cases.iter().map(|c| (c.prompt_ids.len() + c.generated_ids.len()).div_ceil(16)).max().unwrap() + 2
}

fn engine(model: &str, num_blocks: usize, setup: &Setup) -> Engine {
    let dir = test_data().join("models").join(model);
    let files = ModelFiles::resolve(&ModelSource::Dir(dir), Need::Weights).unwrap();
    let (plan, device) = match setup.on_plan {
        true => {
            let (target, device) = worker::runner::device::test_plan();
            (Some(target), device)
        }
        false => (None, worker::runner::device::test_device()),
    };
    let config = EngineConfig {
        num_blocks: Some(num_blocks),
        device,
        plan,
        kv_cache_dtype: setup.kv_cache_dtype,
        kv_tier: setup.tier.clone(),
        ..EngineConfig::default()
    };
    Engine::new(&files, config).unwrap()
}

/// Each case alone, in order: its greedy tokens.
fn round(e: &mut Engine, cases: &[Case], first_id: u64) -> Vec<Vec<u32>> {
    cases
        .iter()
        .enumerate()
        .map(|(i, case)| {
            let params = SamplingParams {
                max_tokens: case.generated_ids.len() as u32,
                ignore_eos: true,
                ..SamplingParams::greedy(0)
            };
            e.add_request(RequestId(first_id + i as u64), case.prompt_ids.clone(), params, 0).unwrap();
            let mut ids = Vec::new();
            while e.has_unfinished() {
                for out in e.step().unwrap() {
                    ids.extend(out.new_token_ids);
                }
            }
            e.scheduler().check_invariants();
            ids
        })
        .collect()
}

fn expected(golden: &Golden) -> Vec<Vec<u32>> {
    golden.cases.iter().map(|c| c.generated_ids.clone()).collect()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyvllm-kv-tier-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The block files under a tier directory (every identity's).
fn block_files(root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for sub in std::fs::read_dir(root).unwrap() {
        let sub = sub.unwrap().path();
        if sub.is_dir() {
            for f in std::fs::read_dir(&sub).unwrap() {
                let f = f.unwrap().path();
                if f.extension().is_some_and(|e| e == "kvb") {
                    files.push(f);
                }
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_golden_model_is_exact_with_blocks_restored_from_memory() {
    for file in GOLDEN {
        let golden = load_golden(file);
        let mut e = engine(&golden.model, small_pool(&golden.cases), &memory_tier());
        assert_eq!(round(&mut e, &golden.cases, 0), expected(&golden), "{file}: first round");
        let before = e.stats().tier;
        assert!(before.offloaded > 0, "{file}: nothing was offloaded: {before:?}");
        assert_eq!(round(&mut e, &golden.cases, 100), expected(&golden), "{file}: blocks restored");
        let after = e.stats().tier;
        assert!(after.restored > before.restored, "{file}: nothing was restored: {after:?}");
        assert!(after.hit_tokens >= 16 * after.restored, "{file}: {after:?}");
    }
}

/// f16 and q8_0 caches: the tier keeps their blocks as stored, and the
/// second round gives what recomputing them (no tier) gives.
#[test]
fn f16_and_q8_0_caches_restore_exactly() {
    for file in ["stories260K.json", "tiny-qwen3.json", "tiny-llama3.json", "tiny-gpt-oss.json"] {
        let golden = load_golden(file);
        for format in [KvCacheDtype::F16, KvCacheDtype::Q8_0] {
            let pool = small_pool(&golden.cases);
            let mut reference = engine(&golden.model, pool, &Setup { kv_cache_dtype: Some(format), ..no_tier() });
            let computed = [round(&mut reference, &golden.cases, 0), round(&mut reference, &golden.cases, 100)];
            let mut e = engine(&golden.model, pool, &Setup { kv_cache_dtype: Some(format), ..memory_tier() });
            let restored = [round(&mut e, &golden.cases, 0), round(&mut e, &golden.cases, 100)];
            assert_eq!(restored, computed, "{file} {format}");
            assert!(e.stats().tier.restored > 0, "{file} {format}: {:?}", e.stats().tier);
        }
    }
}

/// A new engine on the same directory (a restart) finds the blocks the
/// first one wrote, loads them when prompts hit them, and is exact.
#[test]
fn a_disk_tier_outlives_its_engine_for_every_golden_model() {
    let root = temp_dir("restart");
    for file in GOLDEN {
        let golden = load_golden(file);
        let pool = small_pool(&golden.cases);
        {
            let mut first = engine(&golden.model, pool, &disk_tier(&root));
            assert_eq!(round(&mut first, &golden.cases, 0), expected(&golden), "{file}: first engine");
        } // dropped: its queued writes finish
        let mut second = engine(&golden.model, pool, &disk_tier(&root));
        let adopted = second.stats().tier.blocks;
        assert!(adopted > 0, "{file}: the restarted engine found nothing");
        assert!(second.tier_snapshot().len() == adopted, "{file}: it announces what it holds");
        assert_eq!(round(&mut second, &golden.cases, 100), expected(&golden), "{file}: restored from disk");
        let stats = second.stats().tier;
        assert!(stats.loads > 0 && stats.restored > 0, "{file}: {stats:?}");
        assert_eq!(stats.load_failures, 0, "{file}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The Metal step plan's pools (in the emulator) go to disk and back.
#[test]
fn the_metal_plan_restores_from_disk_after_a_restart() {
    let root = temp_dir("plan");
    let golden = load_golden("stories260K.json");
    let pool = small_pool(&golden.cases);
    let on_plan = |root: &Path| Setup { on_plan: true, ..disk_tier(root) };
    {
        let mut first = engine(&golden.model, pool, &on_plan(&root));
        assert_eq!(round(&mut first, &golden.cases, 0), expected(&golden));
        assert!(first.stats().tier.offloaded > 0);
    }
    let mut second = engine(&golden.model, pool, &on_plan(&root));
    assert_eq!(round(&mut second, &golden.cases, 100), expected(&golden));
    assert!(second.stats().tier.restored > 0, "{:?}", second.stats().tier);
    let _ = std::fs::remove_dir_all(&root);
}

/// Damaged files (a flipped byte, a truncation) are refused by their
/// checksum or length, deleted, and their tokens recomputed: still exact.
#[test]
fn damaged_block_files_are_dropped_and_recomputed() {
    let root = temp_dir("damaged");
    let golden = load_golden("tiny-qwen3.json");
    let pool = small_pool(&golden.cases);
    {
        let mut first = engine(&golden.model, pool, &disk_tier(&root));
        round(&mut first, &golden.cases, 0);
    }
    let files = block_files(&root);
    assert!(files.len() > 4);
    for (i, path) in files.iter().enumerate() {
        let mut bytes = std::fs::read(path).unwrap();
        if i % 3 == 0 {
            let mid = bytes.len() / 2;
            bytes[mid] ^= 0x40;
        } else if i % 3 == 1 {
            let last = bytes.len() - 1;
            bytes[last] ^= 1; // the checksum itself
        } else {
            continue;
        }
        std::fs::write(path, bytes).unwrap();
    }
    // One more, truncated: found at start, dropped there.
    let cut = &files[2];
    let bytes = std::fs::read(cut).unwrap();
    std::fs::write(cut, &bytes[..bytes.len() / 2]).unwrap();
    let mut second = engine(&golden.model, pool, &disk_tier(&root));
    assert_eq!(second.stats().tier.blocks, files.len() - 1, "the truncated file is not adopted");
    assert!(!cut.exists());
    assert_eq!(round(&mut second, &golden.cases, 100), expected(&golden));
    let stats = second.stats().tier;
    assert!(stats.load_failures > 0, "{stats:?}");
    assert_eq!(second.tier_store_stats().unwrap().damaged, stats.load_failures);
    let _ = std::fs::remove_dir_all(&root);
}

/// A disk that fills mid-write (each write into /dev/full: "No space left
/// on device" after the first buffer) degrades to plain eviction: the
/// blocks are dropped, counted and recomputed, exactly.
#[test]
fn a_full_disk_degrades_to_eviction() {
    let root = temp_dir("full");
    let golden = load_golden("tiny-llama3.json");
    let pool = small_pool(&golden.cases);
    let mut e = engine(&golden.model, pool, &disk_tier(&root));
    let dir = std::fs::read_dir(&root).unwrap().next().unwrap().unwrap().path();
    // Every block the golden cases make (prompt and output): its first write lands in /dev/full.
    for case in &golden.cases {
        let history: Vec<u32> = case.prompt_ids.iter().chain(&case.generated_ids).copied().collect();
        for hash in common::hash_prompt_blocks(&history, 16) {
            let tmp = dir.join(format!("{:016x}.tmp", hash.0));
            let _ = std::os::unix::fs::symlink("/dev/full", tmp);
        }
    }
    assert_eq!(round(&mut e, &golden.cases, 0), expected(&golden));
    assert_eq!(round(&mut e, &golden.cases, 100), expected(&golden));
    let store = e.tier_store_stats().unwrap();
    assert!(store.write_failures > 0, "{store:?}");
    assert!(e.stats().tier.dropped >= store.write_failures);
    assert!(block_files(&root).len() < store.write_failures as usize, "only blocks written again got files");
    let _ = std::fs::remove_dir_all(&root);
}

/// A tier written under another cache format is never read: the engine
/// keeps its own directory beside it.
#[test]
fn another_format_never_reads_the_tier() {
    let root = temp_dir("identity");
    let golden = load_golden("stories260K.json");
    let pool = small_pool(&golden.cases);
    {
        let mut first = engine(&golden.model, pool, &disk_tier(&root));
        round(&mut first, &golden.cases, 0);
    }
    let f16 = Setup { kv_cache_dtype: Some(KvCacheDtype::F16), ..disk_tier(&root) };
    let second = engine(&golden.model, pool, &f16);
    assert_eq!(second.stats().tier.blocks, 0);
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 2, "one directory per identity");
    let _ = std::fs::remove_dir_all(&root);
}

/// Peer fetch's engine side, for every golden model: one engine serves
/// the cases; another, which never saw them, keeps the blocks the first
/// exports for each prompt and gives transformers' tokens from them.
#[test]
fn blocks_exported_by_one_engine_serve_another_exactly_for_every_golden_model() {
    for file in GOLDEN {
        let golden = load_golden(file);
        let mut holder = engine(&golden.model, 512, &no_tier());
        assert_eq!(round(&mut holder, &golden.cases, 0), expected(&golden), "{file}: the holder");
        let mut receiver = engine(&golden.model, 512, &memory_tier());
        assert_eq!(receiver.kv_identity(), holder.kv_identity(), "{file}: one identity");
        let mut sent = 0;
        for case in &golden.cases {
            let chain = common::hash_prompt_blocks(&case.prompt_ids, 16);
            let blocks = holder.export_kv_blocks(&chain).unwrap();
            assert_eq!(blocks.len(), chain.len(), "{file}: the holder has every full block of the prompt");
            sent += receiver.import_kv_blocks(holder.kv_identity(), blocks);
        }
        assert!(sent > 0, "{file}");
        assert_eq!(round(&mut receiver, &golden.cases, 100), expected(&golden), "{file}: from the peer's blocks");
        let stats = receiver.stats().tier;
        assert!(stats.imported as usize == sent && stats.restored > 0, "{file}: {stats:?}");
    }
}

/// A peer's blocks that are not what their hashes say (other tokens, a
/// parent its hash does not name, another size or identity) are refused, and the prompt is
/// computed, exactly.
#[test]
fn blocks_that_do_not_match_their_hashes_are_refused() {
    let golden = load_golden("stories260K.json");
    let case = golden.cases.iter().max_by_key(|c| c.prompt_ids.len()).unwrap().clone();
    let mut holder = engine(&golden.model, 512, &no_tier());
    round(&mut holder, std::slice::from_ref(&case), 0);
    let chain = common::hash_prompt_blocks(&case.prompt_ids, 16);
    let good = holder.export_kv_blocks(&chain).unwrap();
    let mut receiver = engine(&golden.model, 512, &memory_tier());
    let identity = holder.kv_identity();
    let mut other_tokens = good.clone();
    other_tokens[0].tokens[3] ^= 1;
    assert_eq!(receiver.import_kv_blocks(identity, other_tokens[..1].to_vec()), 0, "tokens its hash does not name");
    let mut forged_parent = good.clone();
    forged_parent[1].parent = Some(good[3].hash);
    assert_eq!(receiver.import_kv_blocks(identity, forged_parent[1..2].to_vec()), 0, "a parent its hash does not name");
    let mut short = good.clone();
    short[1].bytes.pop();
    assert_eq!(receiver.import_kv_blocks(identity, short[1..2].to_vec()), 0, "another block size");
    assert_eq!(receiver.import_kv_blocks(identity ^ 1, good.clone()), 0, "another identity");
    assert_eq!(round(&mut receiver, std::slice::from_ref(&case), 100), vec![case.generated_ids.clone()]);
}
