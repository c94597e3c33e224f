//! A model split into pipeline stages computes exactly what the whole model
//! does: the stages' layers chained through their hidden states give
//! bit-identical logits, for models with tied (stories260K) and untied
//! (tiny-qwen3) embeddings, split in 2 and in 3. In process, no network.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use common::pipeline::{LayerRange, split_layers};
use kernels::AttentionMetadata;
use worker::models::llama::{StageInput, StageOutput};
use worker::models::loader::load_stage;
use worker::models::{ModelFiles, ModelSource, Need};
use worker::runner::kv_cache;
use worker::runner::kv_cache::stage_kv_config;

fn files(model: &str) -> ModelFiles {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/models")).join(model);
    ModelFiles::resolve(&ModelSource::Dir(dir), Need::Weights).unwrap()
}

/// The logits of every row of `ids` (one sequence, from position 0),
/// through `stages` in order.
fn logits_through(files: &ModelFiles, stages: &[LayerRange], ids: &[u32]) -> Vec<f32> {
    let (t, bs) = (ids.len(), 16);
    let meta = AttentionMetadata {
        query_start_loc: vec![0, t as u32],
        context_lens: vec![t as u32],
        block_tables: vec![(0..t.div_ceil(bs) as u32).collect()],
        slot_mapping: (0..t as u32).collect(),
        block_size: bs,
        sliding_window: files.config.sliding_window,
    };
    let positions = Tensor::from_vec((0..t as u32).collect::<Vec<_>>(), t, &Device::Cpu).unwrap();
    let rows = positions.clone();
    let input_ids = Tensor::from_slice(ids, t, &Device::Cpu).unwrap();
    let mut hidden: Option<Tensor> = None;
    for &range in stages {
        let model = load_stage(files, DType::F32, &Device::Cpu, range).unwrap();
        let cfg = stage_kv_config(model.config(), range);
        let kv = kv_cache::allocate(&cfg, t.div_ceil(bs), bs, kernels::KvCacheDtype::F32, &Device::Cpu).unwrap();
        let input = match &hidden {
            None => StageInput::Tokens(&input_ids),
            Some(h) => StageInput::Hidden(h),
        };
        match model.forward_stage(input, &positions, &kv, &meta, &rows).unwrap() {
            StageOutput::Hidden(h) => hidden = Some(h),
            StageOutput::Logits(l) => return l.flatten_all().unwrap().to_vec1().unwrap(),
        }
    }
    panic!("the last stage returned no logits");
}

#[test]
fn stages_chained_give_the_whole_models_logits_bit_for_bit() {
    let ids = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267];
    for model in ["stories260K", "tiny-qwen3"] {
        let files = files(model);
        let n = files.config.num_layers;
        let whole = logits_through(&files, &[LayerRange::full(n)], &ids);
        for stages in 2..=n.min(3) {
            let split = split_layers(n, &vec![1; stages]).unwrap();
            assert_eq!(logits_through(&files, &split, &ids), whole, "{model} in {stages} stages");
        }
    }
}
