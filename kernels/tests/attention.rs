//! `cpu` and `portable` against `reference` on random inputs: scattered and
//! shuffled block tables, ragged lengths, decode (q_len 1) and prefill /
//! chunked prefill (q_len > 1 on a cached prefix), lengths on and across
//! block boundaries, GQA ratios 1, 2, 3, 4, 7, 8, sliding windows, attention
//! sinks, f32/f16/bf16.

use candle_core::{DType, Device, Tensor};
use kernels::{Attention, AttentionMetadata, CacheWrite, cpu, portable, reference};
use rand::SeedableRng;
use rand::rngs::StdRng;

mod common;
use common::{Case, Geometry, make_case, max_rel_err, to_vec};

fn compare(case: &Case, tol: f32, what: &str) {
    let scale = 1.0 / (case.q.dim(2).unwrap() as f32).sqrt();
    let want = reference::paged_attention(&case.attention(scale)).unwrap();
    let cpu = cpu::paged_attention(&case.attention(scale)).unwrap();
    let portable = portable::paged_attention(&case.attention(scale)).unwrap();
    let (e_cpu, e_portable) = (max_rel_err(&cpu, &want), max_rel_err(&portable, &want));
    assert!(e_cpu < tol, "{what}: cpu relative error {e_cpu}");
    assert!(e_portable < tol, "{what}: portable relative error {e_portable}");
    assert_eq!((cpu.dtype(), portable.dtype()), (case.q.dtype(), case.q.dtype()));
    assert_eq!((cpu.dims(), portable.dims()), (case.q.dims(), case.q.dims()));
    if case.q.dtype() == DType::F32 {
        // Into a view of a reused buffer holding garbage, with rows after it
        // that must stay untouched.
        let (t, h, d) = case.q.dims3().unwrap();
        let buffer = Tensor::full(7f32, (t + 3, h, d), &Device::Cpu).unwrap();
        let view = buffer.narrow(0, 0, t).unwrap();
        let q = case.q.contiguous().unwrap();
        cpu::paged_attention_into(
            &Attention { q: &q, k_cache: &case.k_cache, v_cache: &case.v_cache, meta: &case.meta, scale, sinks: None },
            &view,
        )
        .unwrap();
        assert_eq!(to_vec(&view), to_vec(&cpu), "{what}: into a buffer");
        assert!(to_vec(&buffer.narrow(0, t, 3).unwrap()).iter().all(|&x| x == 7.0), "{what}: wrote past its rows");
    }
}

#[test]
fn matches_reference_across_shapes_in_f32() {
    let mut rng = StdRng::seed_from_u64(7);
    // GQA ratios 1, 2, 4, 8, and 7 and 3 (lanes of 8 partly filled).
    for &(heads, kv_heads) in &[(4, 4), (4, 2), (8, 2), (8, 1), (16, 2), (14, 2), (9, 3)] {
        // 12: not whole 8-lane chunks (the portable loops); 24, 40: the AVX2
        // value loop's 8-lane tail after its 32-lane stretches.
        for &head_dim in &[8, 12, 24, 32, 40, 64] {
            for &block_size in &[8, 16] {
                for (m, seqs) in common::MIXES.iter().enumerate() {
                    let case = make_case(&mut rng, seqs, Geometry::new(heads, kv_heads, head_dim, block_size));
                    compare(&case, 1e-5, &format!("mix {m} heads {heads}/{kv_heads} hd {head_dim} bs {block_size}"));
                }
            }
        }
    }
}

/// Long decode contexts, which the CPU kernel splits into items of 512+
/// keys (block-aligned, each of every kv head on the AVX2 decode path)
/// merged after: just under and over the split, many parts, a window that
/// leaves one part or several, sinks, beside a prefill chunk; GQA groups of
/// 4, 3, 1, 8 and 7 on the AVX2 decode path (head_dims 32, 64, 40) and the
/// portable loops (head_dim 12), an f16 cache.
#[test]
fn long_decode_contexts_split_and_merge_like_the_reference() {
    let mut rng = StdRng::seed_from_u64(23);
    let seqs = [(1, 1024), (1, 1025), (1, 3001), (12, 60), (1, 4500)];
    let shapes = [(8, 2, 32, 16), (9, 3, 12, 5), (4, 4, 64, 16), (9, 3, 64, 16), (32, 4, 64, 16), (14, 2, 40, 16)];
    for (heads, kv_heads, head_dim, block_size) in shapes {
        for window in [None, Some(700), Some(1500)] {
            let g = Geometry { window, ..Geometry::new(heads, kv_heads, head_dim, block_size) };
            let case = make_case(&mut rng, &seqs, g);
            compare(&case, 1e-5, &format!("heads {heads}/{kv_heads} hd {head_dim} bs {block_size} window {window:?}"));
            let scale = 1.0 / (head_dim as f32).sqrt();
            let sinks: Vec<f32> = (0..heads).map(|h| 2.0 + (h as f32 * 0.7).sin()).collect();
            let a = Attention { sinks: Some(&sinks), ..case.attention(scale) };
            let (want, got) = (reference::paged_attention(&a).unwrap(), cpu::paged_attention(&a).unwrap());
            assert!(max_rel_err(&got, &want) < 1e-5, "sinks, window {window:?}: {}", max_rel_err(&got, &want));
        }
    }
    let g = Geometry { dtype: DType::F16, ..Geometry::new(8, 2, 32, 16) };
    compare(&make_case(&mut rng, &seqs, g), 2e-2, "f16 cache");
}

#[test]
fn sliding_window_matches_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    let seqs = [(1, 50), (12, 60), (30, 30), (1, 16), (17, 33)];
    for window in [1, 5, 16, 17, 40, 1000] {
        for block_size in [8, 16] {
            let g = Geometry { window: Some(window), ..Geometry::new(8, 2, 32, block_size) };
            compare(&make_case(&mut rng, &seqs, g), 1e-5, &format!("window {window} bs {block_size}"));
        }
    }
}

/// gpt-oss's sinks: one logit per head joins each softmax. Sinks far below
/// the scores (no effect), around them, and far above (they take almost all
/// the mass, and move the online softmax's max), with windows and GQA, in
/// the AVX2 lanes (head_dim 32) and the portable loops (head_dim 12), and
/// in candle's ops (`portable`, what a Mac runs off the step plan).
#[test]
fn attention_sinks_match_reference() {
    let mut rng = StdRng::seed_from_u64(17);
    let seqs = [(1, 50), (12, 60), (30, 30), (1, 1), (17, 33)];
    for (heads, kv_heads, head_dim, window) in [(8, 2, 32, None), (4, 4, 12, Some(16)), (6, 2, 32, Some(5))] {
        let case = make_case(&mut rng, &seqs, Geometry { window, ..Geometry::new(heads, kv_heads, head_dim, 8) });
        let scale = 1.0 / (head_dim as f32).sqrt();
        for offset in [-60.0f32, 0.0, 8.0] {
            let sinks: Vec<f32> = (0..heads).map(|h| offset + (h as f32 * 0.7).sin()).collect();
            let a = Attention { sinks: Some(&sinks), ..case.attention(scale) };
            let want = reference::paged_attention(&a).unwrap();
            let what = format!("heads {heads}/{kv_heads} hd {head_dim} window {window:?} sinks {offset}");
            for (path, got) in
                [("cpu", cpu::paged_attention(&a).unwrap()), ("portable", portable::paged_attention(&a).unwrap())]
            {
                assert!(max_rel_err(&got, &want) < 1e-5, "{what} {path}: {}", max_rel_err(&got, &want));
            }
            let plain = reference::paged_attention(&case.attention(scale)).unwrap();
            let moved = max_rel_err(&plain, &want);
            assert!(if offset < -50.0 { moved < 1e-6 } else { moved > 1e-3 }, "{what}: sinks moved the output {moved}");
        }
        let wrong = vec![0f32; heads + 1];
        assert!(cpu::paged_attention(&Attention { sinks: Some(&wrong), ..case.attention(scale) }).is_err());
    }
}

#[test]
fn half_precisions_match_within_their_resolution() {
    let mut rng = StdRng::seed_from_u64(3);
    for dtype in [DType::F16, DType::BF16] {
        for (heads, kv_heads, block_size, window) in [(8, 2, 16, None), (8, 8, 8, Some(10)), (32, 4, 16, None)] {
            let g = Geometry { window, dtype, ..Geometry::new(heads, kv_heads, 64, block_size) };
            let case = make_case(&mut rng, &[(1, 33), (9, 40), (16, 16), (1, 8)], g);
            compare(&case, 2e-2, &format!("{dtype:?} heads {heads}/{kv_heads} bs {block_size}"));
        }
    }
}

/// A strided q and caches that start partway into their storage (a narrow
/// of a bigger pool) must be read where they are.
#[test]
fn honours_strides_and_offsets() {
    let mut rng = StdRng::seed_from_u64(13);
    let case = make_case(&mut rng, &[(5, 21), (1, 9)], Geometry::new(8, 2, 32, 8));
    let q = case.q.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    assert!(!q.is_contiguous());
    let pad = |c: &Tensor| {
        let junk = (c.ones_like().unwrap() * 100.0).unwrap();
        Tensor::cat(&[&junk.narrow(0, 0, 3).unwrap(), c], 0).unwrap().narrow(0, 3, c.dim(0).unwrap()).unwrap()
    };
    let (k_cache, v_cache) = (pad(&case.k_cache), pad(&case.v_cache));
    assert!(k_cache.is_contiguous() && k_cache.layout().start_offset() > 0);
    let shifted = Case { q, k_cache, v_cache, meta: case.meta.clone() };
    compare(&shifted, 1e-5, "strided q, offset caches");
}

#[test]
fn empty_batch_gives_empty_output() {
    let mut rng = StdRng::seed_from_u64(17);
    let case = make_case(&mut rng, &[], Geometry::new(4, 2, 8, 8));
    for out in [
        cpu::paged_attention(&case.attention(1.0)).unwrap(),
        portable::paged_attention(&case.attention(1.0)).unwrap(),
        reference::paged_attention(&case.attention(1.0)).unwrap(),
    ] {
        assert_eq!(out.dims(), &[0, 4, 8]);
    }
}

#[test]
fn dispatcher_picks_the_cpu_kernel_on_cpu() {
    let mut rng = StdRng::seed_from_u64(19);
    let case = make_case(&mut rng, &[(3, 20), (1, 40)], Geometry::new(8, 2, 32, 16));
    let got = kernels::paged_attention(&case.attention(0.2)).unwrap();
    let cpu = cpu::paged_attention(&case.attention(0.2)).unwrap();
    assert_eq!(to_vec(&got), to_vec(&cpu));
}

type WriteFn = fn(&CacheWrite) -> kernels::Result<()>;
const WRITERS: [(&str, WriteFn); 3] = [
    ("cpu", cpu::reshape_and_cache),
    ("portable", portable::reshape_and_cache),
    ("dispatch", kernels::reshape_and_cache),
];

#[test]
fn cache_writes_land_in_their_slots_only() {
    let mut rng = StdRng::seed_from_u64(5);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let g = Geometry { dtype, ..Geometry::new(4, 2, 8, 8) };
        let case = make_case(&mut rng, &[(3, 20), (1, 7), (16, 16)], g);
        let t = case.meta.slot_mapping.len();
        let new_k = Tensor::randn(0f32, 1., (t, 2, 8), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let new_v = Tensor::randn(0f32, 1., (t, 2, 8), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
        let expected_k = case.k_cache.copy().unwrap();
        let expected_v = case.v_cache.copy().unwrap();
        reference::reshape_and_cache(&CacheWrite {
            k: &new_k,
            v: &new_v,
            k_cache: &expected_k,
            v_cache: &expected_v,
            slot_mapping: &case.meta.slot_mapping,
        })
        .unwrap();
        // The reference wrote exactly the mapped slots, bit for bit.
        let (before, after, rows) = (to_vec(&case.k_cache), to_vec(&expected_k), to_vec(&new_k));
        let row = 2 * 8;
        for slot in 0..before.len() / row {
            let got = &after[slot * row..][..row];
            match case.meta.slot_mapping.iter().position(|&s| s as usize == slot) {
                Some(t) => assert_eq!(got, &rows[t * row..][..row], "slot {slot}"),
                None => assert_eq!(got, &before[slot * row..][..row], "untouched slot {slot}"),
            }
        }
        for (name, write) in WRITERS {
            let (k, v) = (case.k_cache.copy().unwrap(), case.v_cache.copy().unwrap());
            write(&CacheWrite {
                k: &new_k,
                v: &new_v,
                k_cache: &k,
                v_cache: &v,
                slot_mapping: &case.meta.slot_mapping,
            })
            .unwrap();
            assert_eq!(to_vec(&k), to_vec(&expected_k), "{name} {dtype:?} k");
            assert_eq!(to_vec(&v), to_vec(&expected_v), "{name} {dtype:?} v");
        }
    }
}

/// A prefill step end to end: write the prompt's K/V, then attend over it.
#[test]
fn write_then_attend_matches_reference() {
    let mut rng = StdRng::seed_from_u64(23);
    let case = make_case(&mut rng, &[(12, 12), (4, 30)], Geometry::new(8, 4, 16, 8));
    let t = case.meta.slot_mapping.len();
    let k = Tensor::randn(0f32, 1., (t, 4, 16), &Device::Cpu).unwrap();
    let v = Tensor::randn(0f32, 1., (t, 4, 16), &Device::Cpu).unwrap();
    let mut outs = Vec::new();
    for (name, write) in WRITERS {
        let (k_cache, v_cache) = (case.k_cache.copy().unwrap(), case.v_cache.copy().unwrap());
        write(&CacheWrite {
            k: &k,
            v: &v,
            k_cache: &k_cache,
            v_cache: &v_cache,
            slot_mapping: &case.meta.slot_mapping,
        })
        .unwrap();
        let step = Case { q: case.q.clone(), k_cache, v_cache, meta: case.meta.clone() };
        compare(&step, 1e-5, name);
        outs.push(to_vec(&cpu::paged_attention(&step.attention(0.25)).unwrap()));
    }
    assert!(outs.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn invalid_metadata_is_an_error_not_a_panic() {
    let mut rng = StdRng::seed_from_u64(9);
    let case = make_case(&mut rng, &[(2, 20)], Geometry::new(4, 2, 8, 8));
    let all_fail = |q: &Tensor, k_cache: &Tensor, v_cache: &Tensor, meta: &AttentionMetadata| {
        let a = Attention { q, k_cache, v_cache, meta, scale: 1.0, sinks: None };
        cpu::paged_attention(&a).is_err()
            && portable::paged_attention(&a).is_err()
            && reference::paged_attention(&a).is_err()
    };
    common::assert_rejects_broken_inputs(&case, all_fail);
    let (kc, vc) = (&case.k_cache, &case.v_cache);
    // Mismatched shapes and dtypes.
    let q3 = Tensor::zeros((2, 3, 8), DType::F32, &Device::Cpu).unwrap(); // 3 heads over 2 kv heads
    assert!(all_fail(&q3, kc, vc, &case.meta), "heads not a multiple of kv heads");
    let q16 = Tensor::zeros((2, 4, 16), DType::F32, &Device::Cpu).unwrap();
    assert!(all_fail(&q16, kc, vc, &case.meta), "head_dim differs");

    // Cache writes.
    for (name, write) in WRITERS {
        common::assert_rejects_broken_writes(name, write, kc, vc);
    }
    let k = Tensor::zeros((2, 2, 8), DType::F32, &Device::Cpu).unwrap();
    assert!(
        reference::reshape_and_cache(&CacheWrite {
            k: &k,
            v: &k,
            k_cache: kc,
            v_cache: vc,
            slot_mapping: &[0, 100_000]
        })
        .is_err()
    );
}
