//! A model whose every layer slides hands back the KV blocks its window has
//! left (`engine_core`'s KV cache manager), and the pool gives them to new
//! positions at once: a pool too small for the whole sequence must give
//! the tokens a pool that never reuses a block gives. tiny-mistral with a
//! window of 8 (its weights, its config with `sliding_window` set).

mod support;

use std::path::{Path, PathBuf};

use candle_core::DType;
use support::{greedy, test_data};
use worker::models::{ModelFiles, ModelSource, Need};
use worker::{Engine, EngineConfig};

/// tiny-mistral's files with `sliding_window` = `window`.
fn windowed_model(window: usize) -> PathBuf {
    support::model_with_config(&test_data().join("models/tiny-mistral"), &format!("window-{window}"), |config| {
        config["sliding_window"] = window.into();
    })
}

fn engine(model: &Path, num_blocks: usize) -> Engine {
    let files = ModelFiles::resolve(&ModelSource::parse(model.to_str().unwrap()).unwrap(), Need::Weights).unwrap();
    assert_eq!(files.config.uniform_window(), Some(8));
    let config = EngineConfig {
        num_blocks: Some(num_blocks),
        block_size: 4,
        max_num_batched_tokens: 8,
        dtype: DType::F32,
        ..EngineConfig::default()
    };
    Engine::new(&files, config).unwrap()
}

#[test]
fn released_blocks_serve_new_positions_without_changing_a_token() {
    let model = windowed_model(8);
    // 40 prompt tokens and 40 generated: 80 positions, 20 blocks of 4.
    let prompt: Vec<u32> = (0..40).map(|t| (t * 37 + 11) % 500 + 3).collect();
    // A pool that never has to reuse a block the window left.
    let roomy = greedy(&mut engine(&model, 256), &prompt, 40);
    // 8 blocks: the window (8) and a chunk (8) need at most 6 at once.
    let mut tight = engine(&model, 8);
    let tokens = greedy(&mut tight, &prompt, 40);
    assert_eq!(tokens.len(), 40, "the sequence outgrew the pool and was cut");
    assert_eq!(tokens, roomy);
    // The window changes what the model sees: full attention differs.
    let mut full = engine_without_window();
    assert_ne!(greedy(&mut full, &prompt, 40), roomy, "the window made no difference: the test proves nothing");
    std::fs::remove_dir_all(&model).unwrap();
}

/// tiny-mistral as published: the same weights, no window.
fn engine_without_window() -> Engine {
    let files = ModelFiles::resolve(
        &ModelSource::parse(test_data().join("models/tiny-mistral").to_str().unwrap()).unwrap(),
        Need::Weights,
    )
    .unwrap();
    let config = EngineConfig { num_blocks: Some(256), block_size: 4, dtype: DType::F32, ..EngineConfig::default() };
    Engine::new(&files, config).unwrap()
}
