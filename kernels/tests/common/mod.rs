//! What the attention tests (CPU and Metal) share: random cases of q and
//! paged caches built on the CPU, with scattered, shuffled block tables and
//! spare blocks, and the error measure against the reference.
#![allow(dead_code)] // each test file uses its own part

use candle_core::{DType, Device, Tensor};
use kernels::{Attention, AttentionMetadata, CacheWrite};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// Whether a Metal test that finds no GPU (or no emulator) must fail rather
/// than skip with a note. `TINYVLLM_METAL_REQUIRED=1` requires it (the macOS
/// workflow, as candle's CI sets `CANDLE_METAL_REQUIRED`); `=0` allows the
/// skip (tools/test_aarch64.sh: its cross build has no C++ compiler for the
/// emulator, and the native run of the same tests executes them); otherwise
/// it is required under CI (`CI` set), so a broken emulator build fails there.
pub fn metal_required() -> bool {
    match std::env::var("TINYVLLM_METAL_REQUIRED").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => std::env::var_os("CI").is_some_and(|v| !v.is_empty()),
    }
}

/// The skip of a Metal test that cannot run: a note, or a failure where
/// [`metal_required`].
pub fn metal_unavailable(why: &str) {
    if metal_required() {
        panic!("{why}, and a Metal run is required here (CI or TINYVLLM_METAL_REQUIRED=1)");
    }
    eprintln!("skipping: {why}");
}

pub struct Case {
    pub q: Tensor,
    pub k_cache: Tensor,
    pub v_cache: Tensor,
    pub meta: AttentionMetadata,
}

impl Case {
    /// The attention call on this case's q and caches.
    pub fn attention(&self, scale: f32) -> Attention<'_> {
        Attention { q: &self.q, k_cache: &self.k_cache, v_cache: &self.v_cache, meta: &self.meta, scale, sinks: None }
    }

    pub fn to_device(&self, dev: &Device) -> Case {
        Case {
            q: self.q.to_device(dev).unwrap(),
            k_cache: self.k_cache.to_device(dev).unwrap(),
            v_cache: self.v_cache.to_device(dev).unwrap(),
            meta: self.meta.clone(),
        }
    }
}

/// Batches of (q_len, context_len) per sequence that every kernel is
/// compared on.
pub const MIXES: &[&[(usize, usize)]] = &[
    &[(1, 1)],
    &[(1, 15), (1, 16), (1, 17), (1, 32), (1, 33)], // decode on and across boundaries
    &[(16, 16), (17, 17), (5, 5), (33, 33)],        // whole prompts
    &[(7, 40), (1, 9), (20, 64), (3, 3), (1, 100)], // chunked prefill mixed with decode
    &[(40, 70), (2, 31)],                           // long chunk over several query tiles (CPU) / work items (Metal)
];

/// Head and cache geometry of a case.
#[derive(Clone, Copy)]
pub struct Geometry {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub window: Option<usize>,
    pub dtype: DType,
}

impl Geometry {
    pub fn new(heads: usize, kv_heads: usize, head_dim: usize, block_size: usize) -> Self {
        Self { heads, kv_heads, head_dim, block_size, window: None, dtype: DType::F32 }
    }
}

/// Random q and caches, with (q_len, context_len) per sequence; each
/// sequence's blocks are drawn from a shuffled pool with spares left over.
pub fn make_case(rng: &mut StdRng, seqs: &[(usize, usize)], g: Geometry) -> Case {
    let Geometry { heads, kv_heads, head_dim, block_size, window, dtype } = g;
    let blocks_needed: usize = seqs.iter().map(|&(_, ctx)| ctx.div_ceil(block_size)).sum();
    let num_blocks = blocks_needed + 7; // spare blocks stay untouched
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(rng);
    let mut meta =
        AttentionMetadata { query_start_loc: vec![0], block_size, sliding_window: window, ..Default::default() };
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
    // Queries spread over [-3, 3) give peaked softmaxes, so a wrong running max shows.
    let q: Vec<f32> = randn(t * heads * head_dim).into_iter().map(|x| 3.0 * x).collect();
    let q = Tensor::from_vec(q, (t, heads, head_dim), &dev).unwrap().to_dtype(dtype).unwrap();
    let shape = (num_blocks, block_size, kv_heads, head_dim);
    let n = num_blocks * block_size * kv_heads * head_dim;
    let k_cache = Tensor::from_vec(randn(n), shape, &dev).unwrap().to_dtype(dtype).unwrap();
    let v_cache = Tensor::from_vec(randn(n), shape, &dev).unwrap().to_dtype(dtype).unwrap();
    Case { q, k_cache, v_cache, meta }
}

/// The values of `t` (on any device) as f32 on the host.
pub fn to_vec(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()
}

/// The largest absolute difference between `a` and `b`, relative to the
/// largest magnitude in `b` (the reference).
pub fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (to_vec(a), to_vec(b));
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Asserts that `fails` rejects every broken variant of `case` (a valid
/// one): metadata that does not fit its caches, q in another dtype, a
/// v_cache of another shape, a strided cache.
pub fn assert_rejects_broken_inputs(
    case: &Case,
    fails: impl Fn(&Tensor, &Tensor, &Tensor, &AttentionMetadata) -> bool,
) {
    let (q, kc, vc) = (&case.q, &case.k_cache, &case.v_cache);
    let bad = |edit: fn(&mut AttentionMetadata)| {
        let mut meta = case.meta.clone();
        edit(&mut meta);
        fails(q, kc, vc, &meta)
    };
    assert!(
        bad(|m| {
            m.block_tables[0].pop();
        }),
        "short block table"
    );
    assert!(bad(|m| m.block_tables[0][0] = 10_000), "block id out of range");
    assert!(bad(|m| m.context_lens[0] = 1), "fewer context tokens than new tokens");
    assert!(bad(|m| m.query_start_loc = vec![0, 5]), "query rows past q");
    assert!(bad(|m| m.query_start_loc = vec![1, 2]), "query rows not from 0");
    assert!(bad(|m| m.context_lens.push(3)), "lists of different lengths");
    assert!(bad(|m| m.block_size = 16), "block size differs from the cache's");
    assert!(bad(|m| m.sliding_window = Some(0)), "empty window");
    assert!(fails(&q.to_dtype(DType::F16).unwrap(), kc, vc, &case.meta), "dtype differs");
    assert!(fails(q, kc, &vc.narrow(0, 0, 2).unwrap(), &case.meta), "v_cache shape differs");
    assert!(fails(q, &strided(kc), vc, &case.meta), "non-contiguous cache");
}

/// Asserts that `write` (named `name`) rejects every broken write of two
/// tokens into `kc`/`vc` (valid caches): a slot out of range, too few slots,
/// a slot given twice,
/// k/v in another dtype or of another head_dim, a strided cache.
pub fn assert_rejects_broken_writes(
    name: &str,
    write: impl Fn(&CacheWrite) -> kernels::Result<()>,
    kc: &Tensor,
    vc: &Tensor,
) {
    let (_, _, kv_heads, head_dim) = kc.dims4().unwrap();
    let zeros = |head_dim: usize| Tensor::zeros((2, kv_heads, head_dim), DType::F32, kc.device()).unwrap();
    let k = zeros(head_dim);
    let fails = |k: &Tensor, k_cache: &Tensor, slot_mapping: &[u32]| {
        write(&CacheWrite { k, v: k, k_cache, v_cache: vc, slot_mapping }).is_err()
    };
    assert!(fails(&k, kc, &[0, 100_000]), "{name}: slot out of range");
    assert!(fails(&k, kc, &[0]), "{name}: too few slots");
    assert!(fails(&k, kc, &[3, 3]), "{name}: one slot written twice");
    assert!(fails(&k.to_dtype(DType::F16).unwrap(), kc, &[0, 1]), "{name}: dtype differs");
    assert!(fails(&zeros(2 * head_dim), kc, &[0, 1]), "{name}: head_dim differs");
    assert!(fails(&k, &strided(kc), &[0, 1]), "{name}: non-contiguous cache");
}

/// `cache` with its elements in another order: not contiguous.
pub fn strided(cache: &Tensor) -> Tensor {
    cache.transpose(1, 2).unwrap().contiguous().unwrap().transpose(1, 2).unwrap()
}
