//! `cpu` and `portable` against `reference` on random inputs: scattered and
//! shuffled block tables, ragged lengths, decode (q_len 1) and prefill /
//! chunked prefill (q_len > 1 on a cached prefix), lengths on and across
//! block boundaries, GQA ratios 1, 2, 4, 8, sliding windows, f32/f16/bf16.

use candle_core::{DType, Device, Tensor};
use kernels::{AttentionMetadata, cpu, portable, reference};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

struct Case {
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
}

/// (q_len, context_len) per sequence.
fn make_case(rng: &mut StdRng, seqs: &[(usize, usize)], heads: usize, kv_heads: usize, head_dim: usize, block_size: usize, window: Option<usize>, dtype: DType) -> Case {
    let blocks_needed: usize = seqs.iter().map(|&(_, ctx)| ctx.div_ceil(block_size)).sum();
    let num_blocks = blocks_needed + 7; // spare blocks stay untouched
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(rng);
    let mut meta = AttentionMetadata { query_start_loc: vec![0], block_size, sliding_window: window, ..Default::default() };
    let mut next = 0;
    for &(q_len, ctx) in seqs {
        let n = ctx.div_ceil(block_size);
        let table = ids[next..next + n].to_vec();
        next += n;
        for p in ctx - q_len..ctx {
            meta.slot_mapping.push(table[p / block_size] * block_size as u32 + (p % block_size) as u32);
        }
        meta.block_tables.push(table);
        meta.context_lens.push(ctx as u32);
        meta.query_start_loc.push(meta.query_start_loc.last().unwrap() + q_len as u32);
    }
    let t: usize = seqs.iter().map(|s| s.0).sum();
    let mut randn = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
    let dev = Device::Cpu;
    let q = Tensor::from_vec(randn(t * heads * head_dim), (t, heads, head_dim), &dev).unwrap().to_dtype(dtype).unwrap();
    let shape = (num_blocks, block_size, kv_heads, head_dim);
    let n = num_blocks * block_size * kv_heads * head_dim;
    let k_cache = Tensor::from_vec(randn(n), shape, &dev).unwrap().to_dtype(dtype).unwrap();
    let v_cache = Tensor::from_vec(randn(n), shape, &dev).unwrap().to_dtype(dtype).unwrap();
    Case { q, k_cache, v_cache, meta }
}

fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a: Vec<f32> = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let b: Vec<f32> = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn compare(case: &Case, tol: f32, what: &str) {
    let scale = 1.0 / (case.q.dim(2).unwrap() as f32).sqrt();
    let want = reference::paged_attention(&case.q, &case.k_cache, &case.v_cache, &case.meta, scale).unwrap();
    let cpu = cpu::paged_attention(&case.q, &case.k_cache, &case.v_cache, &case.meta, scale).unwrap();
    let portable = portable::paged_attention(&case.q, &case.k_cache, &case.v_cache, &case.meta, scale).unwrap();
    let (e_cpu, e_portable) = (max_rel_err(&cpu, &want), max_rel_err(&portable, &want));
    assert!(e_cpu < tol, "{what}: cpu relative error {e_cpu}");
    assert!(e_portable < tol, "{what}: portable relative error {e_portable}");
    assert_eq!(cpu.dtype(), case.q.dtype());
}

#[test]
fn matches_reference_across_shapes_in_f32() {
    let mut rng = StdRng::seed_from_u64(7);
    let mixes: &[&[(usize, usize)]] = &[
        &[(1, 1)],
        &[(1, 15), (1, 16), (1, 17), (1, 32), (1, 33)],  // decode on and across boundaries
        &[(16, 16), (17, 17), (5, 5), (33, 33)],          // whole prompts
        &[(7, 40), (1, 9), (20, 64), (3, 3), (1, 100)],   // chunked prefill mixed with decode
        &[(40, 70), (2, 31)],                             // long chunk over several query tiles
    ];
    for &(heads, kv_heads) in &[(4, 4), (4, 2), (8, 2), (8, 1), (16, 2)] {
        for &head_dim in &[8, 32, 64] {
            for &block_size in &[8, 16] {
                for (m, seqs) in mixes.iter().enumerate() {
                    let case = make_case(&mut rng, seqs, heads, kv_heads, head_dim, block_size, None, DType::F32);
                    compare(&case, 1e-5, &format!("mix {m} heads {heads}/{kv_heads} hd {head_dim} bs {block_size}"));
                }
            }
        }
    }
}

#[test]
fn sliding_window_matches_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    for window in [1, 5, 16, 40] {
        let case = make_case(&mut rng, &[(1, 50), (12, 60), (30, 30)], 8, 2, 32, 16, Some(window), DType::F32);
        compare(&case, 1e-5, &format!("window {window}"));
    }
}

#[test]
fn half_precisions_match_within_their_resolution() {
    let mut rng = StdRng::seed_from_u64(3);
    for dtype in [DType::F16, DType::BF16] {
        let case = make_case(&mut rng, &[(1, 33), (9, 40), (16, 16)], 8, 2, 64, 16, None, dtype);
        compare(&case, 2e-2, &format!("{dtype:?}"));
    }
}

#[test]
fn cache_writes_land_in_their_slots_only() {
    let mut rng = StdRng::seed_from_u64(5);
    for dtype in [DType::F32, DType::F16] {
        let case = make_case(&mut rng, &[(3, 20), (1, 7), (16, 16)], 4, 2, 8, 8, None, dtype);
        let t = case.meta.slot_mapping.len();
        let new_k = Tensor::randn(0f32, 1., (t, 2, 8), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let new_v = Tensor::randn(0f32, 1., (t, 2, 8), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let expected_k = case.k_cache.copy().unwrap();
        let expected_v = case.v_cache.copy().unwrap();
        reference::reshape_and_cache(&new_k, &new_v, &expected_k, &expected_v, &case.meta.slot_mapping).unwrap();
        type WriteFn = fn(&Tensor, &Tensor, &Tensor, &Tensor, &[u32]) -> kernels::Result<()>;
        for (name, write) in [("cpu", cpu::reshape_and_cache as WriteFn), ("portable", portable::reshape_and_cache as WriteFn)] {
            let (k, v) = (case.k_cache.copy().unwrap(), case.v_cache.copy().unwrap());
            write(&new_k, &new_v, &k, &v, &case.meta.slot_mapping).unwrap();
            assert_eq!(max_rel_err(&k, &expected_k), 0.0, "{name} {dtype:?} k");
            assert_eq!(max_rel_err(&v, &expected_v), 0.0, "{name} {dtype:?} v");
        }
        // The reference really wrote something.
        assert!(max_rel_err(&expected_k, &case.k_cache) > 0.0);
    }
}

#[test]
fn invalid_metadata_is_an_error_not_a_panic() {
    let mut rng = StdRng::seed_from_u64(9);
    let case = make_case(&mut rng, &[(2, 20)], 4, 2, 8, 8, None, DType::F32);
    let run = |meta: &AttentionMetadata| {
        (
            cpu::paged_attention(&case.q, &case.k_cache, &case.v_cache, meta, 1.0).is_err(),
            portable::paged_attention(&case.q, &case.k_cache, &case.v_cache, meta, 1.0).is_err(),
            reference::paged_attention(&case.q, &case.k_cache, &case.v_cache, meta, 1.0).is_err(),
        )
    };
    let mut short_table = case.meta.clone();
    short_table.block_tables[0].pop();
    assert_eq!(run(&short_table), (true, true, true));
    let mut bad_block = case.meta.clone();
    bad_block.block_tables[0][0] = 10_000;
    assert_eq!(run(&bad_block), (true, true, true));
    let mut bad_len = case.meta.clone();
    bad_len.context_lens[0] = 1; // fewer than its 2 new tokens
    assert_eq!(run(&bad_len), (true, true, true));
    let mut bad_start = case.meta.clone();
    bad_start.query_start_loc = vec![0, 5];
    assert_eq!(run(&bad_start), (true, true, true));
    let k = Tensor::zeros((2, 2, 8), DType::F32, &Device::Cpu).unwrap();
    assert!(cpu::reshape_and_cache(&k, &k, &case.k_cache, &case.v_cache, &[0, 100_000]).is_err());
    assert!(portable::reshape_and_cache(&k, &k, &case.k_cache, &case.v_cache, &[0]).is_err());
    let wrong_dtype = k.to_dtype(DType::F16).unwrap();
    assert!(cpu::reshape_and_cache(&wrong_dtype, &wrong_dtype, &case.k_cache, &case.v_cache, &[0, 1]).is_err());
}
