//! The Metal kernels against `reference`, on the cases of
//! tests/attention.rs: scattered and shuffled block tables, ragged lengths,
//! decode and chunked prefill on a cached prefix, GQA ratios 1 to 16, sliding
//! windows, contexts crossing decode partitions, f32/f16/bf16 (and f16
//! caches under f32 queries, `--kv-cache-dtype f16`), buffer
//! offsets, NaN in unused cache slots, and bad inputs. Cases are built on
//! the CPU and the reference runs there.
//!
//! On macOS the kernels run on `Device::new_metal(0)` (without a Metal
//! device every test prints a note and passes). On Linux they run in the CPU
//! emulator of kernels/metal-emu, through the same host planning code
//! (`kernels::metal::plan`), each call twice in two thread orders that must
//! agree bit for bit (common/metal_emulated.rs).
#![cfg(any(target_os = "macos", target_os = "linux"))]

use candle_core::{DType, Device, Tensor};
use kernels::metal::{HEAD_DIMS, PARTITION_SIZE};
use kernels::{Attention, AttentionMetadata, CacheWrite, reference};
use rand::SeedableRng;
use rand::rngs::StdRng;

mod common;
use common::{Case, Geometry, make_case, to_vec};

#[cfg(target_os = "macos")]
#[path = "common/metal_device.rs"]
mod gpu;
#[cfg(target_os = "linux")]
#[path = "common/metal_emulated.rs"]
mod gpu;
use gpu::Gpu;

/// f32 outputs differ from the f64 reference by fast-math exp and another
/// summation order; f16/bf16 by their own resolution.
const F32_TOL: f32 = 1e-4;
const HALF_TOL: f32 = 2e-2;

/// [`common::max_rel_err`] of an output that must be finite.
fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    assert!(to_vec(a).iter().all(|x| x.is_finite()), "non-finite output");
    common::max_rel_err(a, b)
}

/// Runs the Metal kernel on `case` and compares it with the reference.
fn compare(gpu: &Gpu, case: &Case, tol: f32, what: &str) {
    let scale = 1.0 / (case.q.dim(2).unwrap() as f32).sqrt();
    let want = reference::paged_attention(&case.attention(scale)).unwrap();
    let got = gpu.attention(&case.attention(scale)).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!((got.dtype(), got.dims()), (case.q.dtype(), case.q.dims()), "{what}");
    let err = max_rel_err(&got, &want);
    assert!(err < tol, "{what}: metal relative error {err}");
}

#[test]
fn matches_reference_across_shapes_in_f32() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    // GQA ratios 1, 2, 4, 8, and 12 and 16 (a decode threadgroup serves up
    // to 8 heads of a group: larger groups take several, the last partial).
    for &(heads, kv_heads) in &[(4, 4), (4, 2), (8, 2), (8, 1), (16, 2), (24, 2), (16, 1)] {
        for &head_dim in &[32, 64, 128] {
            for &block_size in &[8, 16] {
                for (m, seqs) in common::MIXES.iter().enumerate() {
                    let case = make_case(&mut rng, seqs, Geometry::new(heads, kv_heads, head_dim, block_size));
                    let what = format!("mix {m} heads {heads}/{kv_heads} hd {head_dim} bs {block_size}");
                    compare(&gpu, &case, F32_TOL, &what);
                }
            }
        }
    }
}

#[test]
fn every_head_dim_and_odd_block_sizes() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(29);
    for &head_dim in &HEAD_DIMS {
        for &block_size in &[1, 5, 16, 32] {
            let case = make_case(&mut rng, &[(1, 37), (9, 50), (2, 2)], Geometry::new(8, 2, head_dim, block_size));
            compare(&gpu, &case, F32_TOL, &format!("hd {head_dim} bs {block_size}"));
            // A group of 6 (hd 256 serves 4 heads a threadgroup: 4 + 2).
            let case = make_case(&mut rng, &[(1, 37), (1, 50)], Geometry::new(12, 2, head_dim, block_size));
            compare(&gpu, &case, F32_TOL, &format!("group 6 hd {head_dim} bs {block_size}"));
        }
    }
}

/// Decode contexts on and around partition boundaries, far past them, and
/// a prefill chunk on a long cached prefix, in one batch.
#[test]
fn long_contexts_cross_partitions() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(31);
    let p = PARTITION_SIZE;
    let seqs = [(1, p - 1), (1, p), (1, p + 1), (1, 3 * p + 100), (40, 2 * p + 300), (1, 20)];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let tol = if dtype == DType::F32 { F32_TOL } else { HALF_TOL };
        for window in [None, Some(700), Some(p), Some(33)] {
            let g = Geometry { window, dtype, ..Geometry::new(8, 2, 128, 16) };
            compare(&gpu, &make_case(&mut rng, &seqs, g), tol, &format!("{dtype:?} window {window:?}"));
        }
    }
    // Only long decodes: every sequence goes through the reduce.
    let case = make_case(&mut rng, &[(1, 4 * p + 1); 3], Geometry::new(4, 4, 64, 32));
    compare(&gpu, &case, F32_TOL, "decode only, 5 partitions");
}

/// gpt-oss's attention sinks: each head's logit joins its softmax in the
/// single-pass decode, the partitions' reduce and the prefill, with and
/// without a window, sinks far below, around and above the scores.
#[test]
fn attention_sinks_match_reference() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(41);
    let p = PARTITION_SIZE;
    let seqs = [(1, 40), (1, p + 30), (12, 60), (1, 1), (20, 20)];
    for (heads, kv_heads) in [(8, 2), (4, 4)] {
        for offset in [-60.0f32, 0.0, 8.0] {
            for window in [None, Some(16)] {
                let g = Geometry { window, ..Geometry::new(heads, kv_heads, 64, 16) };
                let case = make_case(&mut rng, &seqs, g);
                let sinks: Vec<f32> = (0..heads).map(|h| offset + h as f32 * 0.7 - 1.0).collect();
                let scale = 0.125;
                let call = Attention { sinks: Some(&sinks), ..case.attention(scale) };
                let want = reference::paged_attention(&call).unwrap();
                let plain = reference::paged_attention(&case.attention(scale)).unwrap();
                let got = gpu.attention(&call).unwrap();
                let what = format!("heads {heads}/{kv_heads} sinks {offset} window {window:?}");
                assert!(max_rel_err(&got, &want) < F32_TOL, "{what}: {}", max_rel_err(&got, &want));
                if offset > 0.0 {
                    assert!(max_rel_err(&plain, &want) > 0.1, "{what}: the sinks change nothing");
                }
            }
        }
    }
}

#[test]
fn sliding_window_matches_reference() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(11);
    let seqs = [(1, 50), (12, 60), (30, 30), (1, 16), (17, 33)];
    for window in [1, 5, 16, 17, 40, 1000] {
        for block_size in [8, 16] {
            let g = Geometry { window: Some(window), ..Geometry::new(8, 2, 32, block_size) };
            compare(&gpu, &make_case(&mut rng, &seqs, g), F32_TOL, &format!("window {window} bs {block_size}"));
        }
    }
}

#[test]
fn half_precisions_match_within_their_resolution() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(3);
    for dtype in [DType::F16, DType::BF16] {
        for (heads, kv_heads, head_dim, block_size, window) in [
            (8, 2, 64, 16, None),
            (8, 8, 64, 8, Some(10)),
            (32, 4, 128, 16, None),
            (8, 1, 256, 16, None),
            (4, 2, 96, 8, None),
        ] {
            let g = Geometry { window, dtype, ..Geometry::new(heads, kv_heads, head_dim, block_size) };
            let case = make_case(&mut rng, &[(1, 33), (9, 40), (16, 16), (1, 8)], g);
            compare(
                &gpu,
                &case,
                HALF_TOL,
                &format!("{dtype:?} heads {heads}/{kv_heads} hd {head_dim} bs {block_size}"),
            );
        }
    }
}

/// `--kv-cache-dtype f16` under f32 activations: the kernels read (and the
/// write rounds into) f16 caches, computing in f32, so they match the
/// reference on the same stored values as closely as an f32 cache does.
#[test]
fn f16_caches_under_f32_queries_match_reference() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(61);
    let long = PARTITION_SIZE + 37; // decode across partitions, then the reduce
    for (heads, kv_heads, head_dim, block_size, window) in
        [(8, 2, 64, 16, None), (8, 8, 32, 8, Some(10)), (32, 4, 128, 16, None), (4, 2, 96, 8, None)]
    {
        let g = Geometry { window, ..Geometry::new(heads, kv_heads, head_dim, block_size) };
        let mut case = make_case(&mut rng, &[(1, 33), (9, 40), (16, 16), (1, long)], g);
        case.k_cache = case.k_cache.to_dtype(DType::F16).unwrap();
        case.v_cache = case.v_cache.to_dtype(DType::F16).unwrap();
        compare(&gpu, &case, F32_TOL, &format!("f16 cache heads {heads}/{kv_heads} hd {head_dim} bs {block_size}"));

        let t = case.meta.slot_mapping.len();
        let new = || Tensor::randn(0f32, 1., (t, kv_heads, head_dim), &Device::Cpu).unwrap();
        let (new_k, new_v) = (new(), new());
        let (want_k, want_v) = reference_write(&case, &new_k, &new_v);
        let write = CacheWrite {
            k: &new_k,
            v: &new_v,
            k_cache: &case.k_cache,
            v_cache: &case.v_cache,
            slot_mapping: &case.meta.slot_mapping,
        };
        let (k, v) = gpu.write(&write).unwrap();
        assert_eq!((k.dtype(), to_vec(&k)), (DType::F16, to_vec(&want_k)), "f16 cache write k");
        assert_eq!(to_vec(&v), to_vec(&want_v), "f16 cache write v");
    }
}

/// A strided q and caches that start partway into their storage must be
/// read where they are.
#[test]
fn honours_strides_and_offsets() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(13);
    let case = make_case(&mut rng, &[(5, 21), (1, 9), (1, 700)], Geometry::new(8, 2, 32, 8));
    let want = reference::paged_attention(&case.attention(0.3)).unwrap();
    let q = case.q.transpose(0, 1).unwrap().contiguous().unwrap().transpose(0, 1).unwrap();
    let pad = |c: &Tensor| {
        let junk = (c.ones_like().unwrap() * 100.0).unwrap();
        Tensor::cat(&[&junk.narrow(0, 0, 3).unwrap(), c], 0).unwrap().narrow(0, 3, c.dim(0).unwrap()).unwrap()
    };
    let shifted = Case { q, k_cache: pad(&case.k_cache), v_cache: pad(&case.v_cache), meta: case.meta.clone() };
    assert!(!shifted.q.is_contiguous());
    assert!(shifted.k_cache.is_contiguous() && shifted.k_cache.layout().start_offset() > 0);
    let got = gpu.attention(&shifted.attention(0.3)).unwrap();
    let err = max_rel_err(&got, &want);
    assert!(err < F32_TOL, "strided q, offset caches: relative error {err}");
}

/// Cache slots no sequence uses (spare blocks, the tail of a last block)
/// may hold anything, NaN included, without reaching the output.
#[test]
fn nan_in_unused_slots_stays_out() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(37);
    let p = PARTITION_SIZE;
    for dtype in [DType::F32, DType::F16] {
        let tol = if dtype == DType::F32 { F32_TOL } else { HALF_TOL };
        let g = Geometry { dtype, ..Geometry::new(8, 2, 64, 16) };
        let case = make_case(&mut rng, &[(1, 21), (7, 40), (1, p + 3)], g);
        let (blocks, bs) = (case.k_cache.dim(0).unwrap(), case.k_cache.dim(1).unwrap());
        let mut used = vec![false; blocks * bs];
        for (s, table) in case.meta.block_tables.iter().enumerate() {
            for pos in 0..case.meta.context_lens[s] as usize {
                used[table[pos / bs] as usize * bs + pos % bs] = true;
            }
        }
        let mask: Vec<f32> = used.iter().map(|&u| if u { 0.0 } else { 1.0 }).collect();
        let mask = Tensor::from_vec(mask, (blocks, bs, 1, 1), &Device::Cpu).unwrap();
        let poison = |c: &Tensor| {
            let nan = Tensor::full(f32::NAN, c.dims(), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            mask.broadcast_as(c.dims()).unwrap().to_dtype(DType::U8).unwrap().where_cond(&nan, c).unwrap()
        };
        let poisoned = Case { k_cache: poison(&case.k_cache), v_cache: poison(&case.v_cache), ..case };
        compare(&gpu, &poisoned, tol, &format!("{dtype:?} with NaN in unused slots"));
    }
}

#[test]
fn empty_batch_gives_empty_output() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(17);
    let case = make_case(&mut rng, &[], Geometry::new(4, 2, 32, 8));
    let out = gpu.attention(&case.attention(1.0)).unwrap();
    assert_eq!(out.dims(), &[0, 4, 32]);
}

/// A new step's K/V written with reference::reshape_and_cache.
fn reference_write(case: &Case, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
    let (want_k, want_v) = (case.k_cache.copy().unwrap(), case.v_cache.copy().unwrap());
    reference::reshape_and_cache(&CacheWrite {
        k,
        v,
        k_cache: &want_k,
        v_cache: &want_v,
        slot_mapping: &case.meta.slot_mapping,
    })
    .unwrap();
    (want_k, want_v)
}

#[test]
fn cache_writes_land_in_their_slots_only() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(5);
    // Rows of 16 elements (fewer than a threadgroup) and of 512 (several passes).
    for (kv_heads, head_dim) in [(2, 8), (4, 128)] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let g = Geometry { dtype, ..Geometry::new(kv_heads, kv_heads, head_dim, 8) };
            let case = make_case(&mut rng, &[(3, 20), (1, 7), (16, 16)], g);
            let t = case.meta.slot_mapping.len();
            let new =
                || Tensor::randn(0f32, 1., (t, kv_heads, head_dim), &Device::Cpu).unwrap().to_dtype(dtype).unwrap();
            let (new_k, new_v) = (new(), new());
            let (want_k, want_v) = reference_write(&case, &new_k, &new_v);
            let (k, v) = gpu
                .write(&CacheWrite {
                    k: &new_k,
                    v: &new_v,
                    k_cache: &case.k_cache,
                    v_cache: &case.v_cache,
                    slot_mapping: &case.meta.slot_mapping,
                })
                .unwrap();
            assert_eq!(to_vec(&k), to_vec(&want_k), "{dtype:?} row {} k", kv_heads * head_dim);
            assert_eq!(to_vec(&v), to_vec(&want_v), "{dtype:?} row {} v", kv_heads * head_dim);
        }
    }
}

/// A prefill step: write the prompt's K/V, then attend over it.
#[test]
fn write_then_attend_matches_reference() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(23);
    let case = make_case(&mut rng, &[(12, 12), (4, 30), (1, 600)], Geometry::new(8, 4, 32, 8));
    let t = case.meta.slot_mapping.len();
    let k = Tensor::randn(0f32, 1., (t, 4, 32), &Device::Cpu).unwrap();
    let v = Tensor::randn(0f32, 1., (t, 4, 32), &Device::Cpu).unwrap();
    let (want_k, want_v) = reference_write(&case, &k, &v);
    let want = reference::paged_attention(&Attention {
        q: &case.q,
        k_cache: &want_k,
        v_cache: &want_v,
        meta: &case.meta,
        scale: 0.25,
        sinks: None,
    })
    .unwrap();
    let write = CacheWrite {
        k: &k,
        v: &v,
        k_cache: &case.k_cache,
        v_cache: &case.v_cache,
        slot_mapping: &case.meta.slot_mapping,
    };
    let (got_k, got_v) = gpu.write(&write).unwrap();
    let written = Case { k_cache: got_k, v_cache: got_v, ..case };
    let got = gpu.attention(&written.attention(0.25)).unwrap();
    let err = max_rel_err(&got, &want);
    assert!(err < F32_TOL, "write then attend: relative error {err}");
}

#[test]
fn invalid_inputs_are_errors_not_panics() {
    let Some(gpu) = Gpu::get() else { return };
    let mut rng = StdRng::seed_from_u64(9);
    let case = make_case(&mut rng, &[(2, 20)], Geometry::new(4, 2, 32, 8));
    let fails = |q: &Tensor, k_cache: &Tensor, v_cache: &Tensor, meta: &AttentionMetadata| {
        gpu.attention(&Attention { q, k_cache, v_cache, meta, scale: 1.0, sinks: None }).is_err()
    };
    common::assert_rejects_broken_inputs(&case, fails);
    let (kc, vc) = (&case.k_cache, &case.v_cache);
    let zeros = |shape: (usize, usize, usize), dtype| Tensor::zeros(shape, dtype, &Device::Cpu).unwrap();
    assert!(fails(&zeros((2, 3, 32), DType::F32), kc, vc, &case.meta), "heads not a multiple of kv heads");
    assert!(fails(&zeros((2, 4, 64), DType::F32), kc, vc, &case.meta), "head_dim differs");
    let hd16 = make_case(&mut rng, &[(2, 20)], Geometry::new(4, 2, 16, 8));
    assert!(fails(&hd16.q, &hd16.k_cache, &hd16.v_cache, &hd16.meta), "head_dim without a kernel");
    common::assert_rejects_broken_writes("metal", |w| gpu.write(w).map(|_| ()), kc, vc);
}

/// The planning code's allocations over decode steps of a 28-layer model:
/// per step, one upload of the slots and one of the attention metadata,
/// shared by every layer; the decode scratch only when a step needs more.
#[cfg(target_os = "linux")]
#[test]
fn allocations_per_step_do_not_grow_with_layers() {
    let Some(gpu) = Gpu::get().map(Gpu::once) else { return };
    let mut rng = StdRng::seed_from_u64(41);
    let (layers, p) = (28, PARTITION_SIZE);
    let mut steps = Vec::new();
    for step in 0..3 {
        // Decoding sequences, one past a partition boundary.
        let seqs = [(1, 30 + step), (1, p + 10 + step), (1, 7 + step)];
        let case = make_case(&mut rng, &seqs, Geometry::new(2, 1, 32, 16));
        let t = case.meta.slot_mapping.len();
        let (k, v) = (Tensor::zeros((t, 1, 32), DType::F32, &Device::Cpu).unwrap(), case.q.narrow(1, 0, 1).unwrap());
        let before = gpu.allocations();
        for _ in 0..layers {
            let write = CacheWrite {
                k: &k,
                v: &v,
                k_cache: &case.k_cache,
                v_cache: &case.v_cache,
                slot_mapping: &case.meta.slot_mapping,
            };
            gpu.write(&write).unwrap();
            gpu.attention(&case.attention(0.2)).unwrap();
        }
        let after = gpu.allocations();
        steps.push((after.uploads - before.uploads, after.scratch - before.scratch));
    }
    // The first step also makes the scratch, kept for the next ones.
    assert_eq!(steps, [(2, 1), (2, 0), (2, 0)], "(uploads, scratch buffers) per step of {layers} layers");
}

/// What only a real GPU shows: the dispatcher's choice and candle's buffers
/// (timing: `cargo bench -p tinyvllm-kernels --bench metal_decode`).
#[cfg(target_os = "macos")]
mod on_device {
    use super::*;
    use kernels::{KernelError, metal};

    /// The dispatcher uses the Metal kernel where it exists and the portable
    /// path for head dims without one.
    #[test]
    fn dispatcher_picks_the_metal_kernel_on_metal() {
        let Some(gpu) = Gpu::get() else { return };
        let dev = &gpu.device;
        let mut rng = StdRng::seed_from_u64(19);
        let m = make_case(&mut rng, &[(3, 20), (1, 40)], Geometry::new(8, 2, 64, 16)).to_device(dev);
        let got = kernels::paged_attention(&m.attention(0.2)).unwrap();
        let direct = metal::paged_attention(&m.attention(0.2)).unwrap();
        assert_eq!(to_vec(&got), to_vec(&direct));

        let case = make_case(&mut rng, &[(3, 20), (1, 40)], Geometry::new(8, 2, 16, 16));
        let m = case.to_device(dev);
        let err = metal::paged_attention(&m.attention(0.2));
        assert!(matches!(err, Err(KernelError::Invalid(_))), "head_dim 16 has no Metal kernel");
        let want = reference::paged_attention(&case.attention(0.2)).unwrap();
        let got = kernels::paged_attention(&m.attention(0.2)).unwrap();
        assert!(max_rel_err(&got, &want) < F32_TOL, "portable fallback");
    }

    #[test]
    fn writes_into_shared_or_overlapping_memory_are_refused() {
        let Some(gpu) = Gpu::get() else { return };
        let dev = &gpu.device;
        let mut rng = StdRng::seed_from_u64(9);
        let case = make_case(&mut rng, &[(2, 20)], Geometry::new(4, 2, 32, 8)).to_device(dev);
        let (kc, vc) = (&case.k_cache, &case.v_cache);
        let k = Tensor::zeros((2, 2, 32), DType::F32, dev).unwrap();
        let q_cpu = case.q.to_device(&Device::Cpu).unwrap();
        let on_cpu = metal::paged_attention(&Attention {
            q: &q_cpu,
            k_cache: kc,
            v_cache: vc,
            meta: &case.meta,
            scale: 1.0,
            sinks: None,
        });
        assert!(on_cpu.is_err(), "q on another device");
        // One dispatch writes both pools, so they must not share memory, nor
        // may the new rows live in the pool they are written into.
        let write = |k: &Tensor, v_cache: &Tensor, slot_mapping: &[u32]| {
            metal::reshape_and_cache(&CacheWrite { k, v: &k.clone(), k_cache: kc, v_cache, slot_mapping })
        };
        assert!(matches!(write(&k, kc, &[0, 1]), Err(KernelError::Invalid(_))), "k_cache is v_cache");
        let inside = kc.flatten_to(1).unwrap().narrow(0, 0, 2).unwrap().reshape((2, 2, 32)).unwrap();
        assert!(matches!(write(&inside, vc, &[5, 6]), Err(KernelError::Invalid(_))), "new k inside k_cache");
    }
}
