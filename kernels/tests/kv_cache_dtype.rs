//! Narrow KV caches (f16, q8_0) against the reference: the writes (narrow
//! or quantize each head vector into its slot) and paged attention reading
//! them (widened per block), on random scattered and shuffled block tables,
//! decode and (chunked) prefill, GQA ratios, head dims on and off the
//! 8-lane width, sliding windows. The reference widens the same stored
//! values in f64, so the kernels must agree with it as closely as on f32.

use candle_core::{DType, Device, Tensor};
use kernels::kv_dtype::Q8_PARAM_BYTES;
use kernels::{Attention, CacheWrite, KvCacheDtype, cpu, portable, reference};
use rand::SeedableRng;
use rand::rngs::StdRng;

mod common;
use common::{Case, Geometry, make_case, max_rel_err, to_vec};

/// `cache` (f32, `[blocks, bs, kv_heads, hd]`) stored as `format`.
fn narrowed(cache: &Tensor, format: KvCacheDtype) -> Tensor {
    match format {
        KvCacheDtype::Q8_0 => {
            let (nb, bs, kvh, hd) = cache.dims4().unwrap();
            let bytes: Vec<u8> = to_vec(cache).chunks_exact(hd).flat_map(reference::quantize_q8_row).collect();
            Tensor::from_vec(bytes, (nb, bs, kvh, hd + Q8_PARAM_BYTES), &Device::Cpu).unwrap()
        }
        f => cache.to_dtype(f.storage_dtype()).unwrap(),
    }
}

fn narrow_case(case: &Case, format: KvCacheDtype) -> Case {
    Case {
        q: case.q.clone(),
        k_cache: narrowed(&case.k_cache, format),
        v_cache: narrowed(&case.v_cache, format),
        meta: case.meta.clone(),
    }
}

/// The CPU kernel (both entry points) and, for f16, the portable path
/// against the reference on the same stored cache.
fn compare(case: &Case, format: KvCacheDtype, what: &str) {
    let scale = 1.0 / (case.q.dim(2).unwrap() as f32).sqrt();
    let want = reference::paged_attention(&case.attention(scale)).unwrap();
    let got = cpu::paged_attention(&case.attention(scale)).unwrap();
    let e = max_rel_err(&got, &want);
    assert!(e < 1e-5, "{what}: cpu relative error {e}");
    assert_eq!(got.dtype(), DType::F32);
    let out = Tensor::full(7f32, case.q.dims(), &Device::Cpu).unwrap();
    cpu::paged_attention_into(&case.attention(scale), &out).unwrap();
    assert_eq!(to_vec(&out), to_vec(&got), "{what}: into a buffer");
    let dispatched = kernels::paged_attention(&case.attention(scale)).unwrap();
    assert_eq!(to_vec(&dispatched), to_vec(&got), "{what}: dispatch");
    match format {
        KvCacheDtype::Q8_0 => assert!(portable::paged_attention(&case.attention(scale)).is_err(), "{what}: portable"),
        _ => {
            let e = max_rel_err(&portable::paged_attention(&case.attention(scale)).unwrap(), &want);
            assert!(e < 1e-5, "{what}: portable relative error {e}");
        }
    }
}

#[test]
fn attention_over_f16_and_q8_caches_matches_reference() {
    let mut rng = StdRng::seed_from_u64(41);
    for format in [KvCacheDtype::F16, KvCacheDtype::Q8_0] {
        for &(heads, kv_heads) in &[(4, 4), (8, 2), (32, 4), (9, 3)] {
            // 12: the portable loops; 64, 40: the AVX2 / NEON lanes.
            for &head_dim in &[12, 40, 64] {
                for (m, seqs) in common::MIXES.iter().enumerate() {
                    let case = make_case(&mut rng, seqs, Geometry::new(heads, kv_heads, head_dim, 16));
                    let what = format!("{format} mix {m} heads {heads}/{kv_heads} hd {head_dim}");
                    compare(&narrow_case(&case, format), format, &what);
                }
            }
        }
        let g = Geometry { window: Some(13), ..Geometry::new(8, 2, 32, 8) };
        let case = make_case(&mut rng, common::MIXES[3], g);
        compare(&narrow_case(&case, format), format, &format!("{format} sliding window"));
    }
}

/// Long decode contexts (split into parts of every kv head, merged after)
/// over f16 and q8_0 caches: GQA groups of 3 (f16 read in place), 8 (f16
/// widened once a block) and 7, a window, beside a prefill chunk.
#[test]
fn long_decode_contexts_over_narrow_caches_match_reference() {
    let mut rng = StdRng::seed_from_u64(53);
    let seqs = [(1, 1025), (12, 60), (1, 3001)];
    for format in [KvCacheDtype::F16, KvCacheDtype::Q8_0] {
        for (heads, kv_heads, head_dim, window) in [(9, 3, 64, None), (32, 4, 64, Some(1500)), (14, 2, 40, None)] {
            let g = Geometry { window, ..Geometry::new(heads, kv_heads, head_dim, 16) };
            let case = make_case(&mut rng, &seqs, g);
            let what = format!("{format} long heads {heads}/{kv_heads} hd {head_dim} window {window:?}");
            compare(&narrow_case(&case, format), format, &what);
        }
    }
}

/// Quantizing is lossy, but only by half a step of each row:
/// attention over a q8_0 cache stays close to attention over f32.
#[test]
fn q8_cache_attention_is_close_to_f32() {
    let mut rng = StdRng::seed_from_u64(43);
    let case = make_case(&mut rng, common::MIXES[3], Geometry::new(32, 4, 64, 16));
    let exact = reference::paged_attention(&case.attention(0.125)).unwrap();
    for (format, tol) in [(KvCacheDtype::F16, 2e-3), (KvCacheDtype::Q8_0, 2e-2)] {
        let narrow = narrow_case(&case, format);
        let e = max_rel_err(&cpu::paged_attention(&narrow.attention(0.125)).unwrap(), &exact);
        assert!(e < tol, "{format}: relative error {e} against the f32 cache");
    }
}

type WriteFn = fn(&CacheWrite) -> kernels::Result<()>;

#[test]
fn writes_narrow_or_quantize_into_their_slots_only() {
    let mut rng = StdRng::seed_from_u64(47);
    let (kvh, hd) = (2, 40);
    let case = make_case(&mut rng, &[(3, 20), (1, 7), (16, 16)], Geometry::new(4, kvh, hd, 8));
    let t = case.meta.slot_mapping.len();
    // Rows with a zero vector (step 0) and one large outlier.
    let mut values: Vec<f32> = (0..t * kvh * hd).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.03).collect();
    values[..hd].iter_mut().for_each(|x| *x = 0.0);
    values[hd + 3] = 900.0;
    let new_k = Tensor::from_vec(values, (t, kvh, hd), &Device::Cpu).unwrap();
    let new_v = (&new_k * -0.5).unwrap();
    for format in [KvCacheDtype::F16, KvCacheDtype::Q8_0] {
        let (k0, v0) = (narrowed(&case.k_cache, format), narrowed(&case.v_cache, format));
        let (want_k, want_v) = (k0.copy().unwrap(), v0.copy().unwrap());
        let write = |f: WriteFn, k_cache: &Tensor, v_cache: &Tensor| {
            f(&CacheWrite { k: &new_k, v: &new_v, k_cache, v_cache, slot_mapping: &case.meta.slot_mapping }).unwrap()
        };
        write(reference::reshape_and_cache, &want_k, &want_v);
        let mut writers: Vec<(&str, WriteFn)> =
            vec![("cpu", cpu::reshape_and_cache), ("dispatch", kernels::reshape_and_cache)];
        if format == KvCacheDtype::F16 {
            writers.push(("portable", portable::reshape_and_cache));
        }
        for (name, f) in writers {
            let (k, v) = (k0.copy().unwrap(), v0.copy().unwrap());
            write(f, &k, &v);
            for (got, want, before) in [(&k, &want_k, &k0), (&v, &want_v, &v0)] {
                match format {
                    KvCacheDtype::Q8_0 => assert_q8_equal(got, want, before, hd, name),
                    _ => assert_eq!(to_vec(got), to_vec(want), "{name} {format}"),
                }
            }
        }
    }
    let q8 = narrowed(&case.k_cache, KvCacheDtype::Q8_0);
    let write = CacheWrite {
        k: &new_k,
        v: &new_v,
        k_cache: &q8,
        v_cache: &q8.copy().unwrap(),
        slot_mapping: &case.meta.slot_mapping,
    };
    assert!(portable::reshape_and_cache(&write).is_err(), "q8_0 is CPU-only");
}

/// Equal steps and minima; codes within one (the kernels round
/// (x - min) * (1 / step) in f32 half to even, the reference (x - min) /
/// step in f64 half away from zero); slots not written untouched.
fn assert_q8_equal(got: &Tensor, want: &Tensor, before: &Tensor, hd: usize, name: &str) {
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
    let (got, want, before) = (bytes(got), bytes(want), bytes(before));
    let row = hd + Q8_PARAM_BYTES;
    for (r, ((g, w), b)) in got.chunks(row).zip(want.chunks(row)).zip(before.chunks(row)).enumerate() {
        assert_eq!(g[hd..], w[hd..], "{name}: step and minimum of row {r}");
        for (i, (&x, &y)) in g[..hd].iter().zip(&w[..hd]).enumerate() {
            assert!((x as i32 - y as i32).abs() <= 1, "{name}: row {r} value {i}: {x} vs {y}");
        }
        if w == b {
            assert_eq!(g, b, "{name}: row {r} was not to be written");
        }
    }
}

#[test]
fn mismatched_narrow_caches_are_errors() {
    let mut rng = StdRng::seed_from_u64(53);
    let case = make_case(&mut rng, &[(2, 20)], Geometry::new(4, 2, 8, 8));
    let q8 = narrow_case(&case, KvCacheDtype::Q8_0);
    let f16 = narrow_case(&case, KvCacheDtype::F16);
    let fails = |q: &Tensor, k: &Tensor, v: &Tensor| {
        let a = Attention { q, k_cache: k, v_cache: v, meta: &case.meta, scale: 1.0, sinks: None };
        cpu::paged_attention(&a).is_err() && reference::paged_attention(&a).is_err()
    };
    assert!(fails(&case.q, &q8.k_cache, &f16.v_cache), "k and v in different formats");
    // A u8 cache whose rows lack the scale.
    let short = Tensor::zeros(case.k_cache.dims(), DType::U8, &Device::Cpu).unwrap();
    assert!(fails(&case.q, &short, &short), "q8_0 rows without a scale");
    let bf16 = case.k_cache.to_dtype(DType::BF16).unwrap();
    assert!(fails(&case.q, &bf16, &bf16), "bf16 cache under f32 queries");
}
