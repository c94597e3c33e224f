//! The step plan's GPU sampler (kernels/src/metal/sample.metal), run in the
//! CPU emulator (on a Mac's GPU in the macOS workflow), against its
//! reference: the host sampler
//! (`runner::sampler::sample_batch`). Every parameter alone and together,
//! seeded, over rows built to hit the edges (ties at the top-k and top-p
//! boundaries, NaN, -inf and +inf logits, masks that forbid everything,
//! bans the grammar overrides), batched with other rows so that each row's
//! edits and mask sit at scattered offsets. Tokens must be identical;
//! logprobs equal to f32 rounding.

use common::{SamplingParams, TokenLogprobs};
use kernels::metal::plan::Allocator;
use kernels::metal::step::{SampleRow, Sampler, TokenEdit};
use worker::runner::logprobs::LogprobsMode;
use worker::runner::plan_sampling::{edits_of, sample_rows, sampled_token};
use worker::runner::sampler::{SamplingRow, sample_batch};

const EOS: u32 = 2;

/// One host row: its params, history, seed and mask.
struct Case {
    params: SamplingParams,
    prompt: Vec<u32>,
    output: Vec<u32>,
    seed: u64,
    mask: Option<Vec<u32>>,
}

impl Case {
    fn new(params: SamplingParams, seed: u64) -> Self {
        Self { params, prompt: vec![5, 6, 7, 5], output: vec![7, 9, 7, 3], seed, mask: None }
    }

    fn row(&self) -> SamplingRow<'_> {
        SamplingRow {
            params: &self.params,
            prompt_token_ids: &self.prompt,
            output_token_ids: &self.output,
            num_output_tokens: self.output.len(),
            seed: self.seed,
            eos_token_ids: &[EOS],
            allowed: self.mask.as_deref(),
        }
    }
}

/// A deterministic stream of logits: a few shapes of row.
struct Logits(u64);

impl Logits {
    fn next(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// Kind 0: smooth, 1: coarse steps (many exact ties), 2: peaked with
    /// NaN and -inf holes.
    fn row(&mut self, vocab: usize, kind: usize) -> Vec<f32> {
        (0..vocab)
            .map(|i| {
                let x = self.next();
                match kind {
                    0 => x * 6.0,
                    1 => (x * 8.0).round() * 0.5,
                    _ if i % 97 == 13 => f32::NAN,
                    _ if i % 89 == 5 => f32::NEG_INFINITY,
                    _ => x * 3.0 + if i % 250 == 7 { 9.0 } else { 0.0 },
                }
            })
            .collect()
    }
}

/// The GPU of these tests: Apple's with `TINYVLLM_TEST_DEVICE=metal` (the
/// macOS CI job), the CPU emulator of our kernels elsewhere.
#[cfg(target_os = "macos")]
type TestGpu = kernels::metal::gpu::MetalGpu;
#[cfg(not(target_os = "macos"))]
type TestGpu = kernels::metal::emulated::EmulatedGpu;

fn test_gpu() -> TestGpu {
    #[cfg(target_os = "macos")]
    {
        let device = worker::runner::device::test_device();
        TestGpu::new(device.as_metal_device().expect("TINYVLLM_TEST_DEVICE=metal").clone()).unwrap()
    }
    #[cfg(not(target_os = "macos"))]
    TestGpu::new().expect("the Metal emulator (metal-emulated) is built for this target")
}

/// Samples `cases` over `logits` on the GPU and on the host, and checks
/// they agree, row by row.
fn check(gpu: &mut TestGpu, vocab: usize, logits: &[f32], cases: &[Case], mode: LogprobsMode) {
    let rows: Vec<SamplingRow> = cases.iter().map(Case::row).collect();
    let edits: Vec<Vec<TokenEdit>> = rows.iter().map(edits_of).collect();
    let params: Vec<SampleRow> = sample_rows(&rows, &edits);
    let sampler = Sampler::new(gpu, vocab, cases.len()).unwrap();
    gpu.prepare([sampler.kernel()]).unwrap();
    let bytes: Vec<u8> = logits.iter().flat_map(|x| x.to_le_bytes()).collect();
    let buffer = gpu.upload(&bytes).unwrap();
    let on_gpu = sampler.sample(gpu, &buffer, &params).unwrap();
    let on_host = sample_batch(logits, vocab, &rows, mode);
    for (i, (gpu_draw, host)) in on_gpu.into_iter().zip(on_host).enumerate() {
        let gpu_draw = sampled_token(gpu_draw, mode);
        let what = format!("row {i} ({:?}, seed {})", cases[i].params, cases[i].seed);
        assert_eq!(gpu_draw.token_id, host.token_id, "{what}");
        match (&gpu_draw.logprobs, &host.logprobs) {
            (None, None) => {}
            (Some(g), Some(h)) => logprobs_close(g, h, &what),
            _ => panic!("{what}: logprobs on one side only"),
        }
    }
}

fn logprobs_close(g: &TokenLogprobs, h: &TokenLogprobs, what: &str) {
    let close = |a: f32, b: f32| a == b || (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-4 * b.abs().max(1.0);
    assert!(close(g.logprob, h.logprob), "{what}: logprob {} vs {}", g.logprob, h.logprob);
    assert_eq!(g.top.len(), h.top.len(), "{what}: top logprobs");
    for (a, b) in g.top.iter().zip(&h.top) {
        assert_eq!(a.0, b.0, "{what}: top ids {:?} vs {:?}", g.top, h.top);
        assert!(close(a.1, b.1), "{what}: top values {:?} vs {:?}", g.top, h.top);
    }
}

fn random() -> SamplingParams {
    SamplingParams { seed: Some(0), ..SamplingParams::default() }
}

/// Every parameter alone and in combination, each over 12 seeds and three
/// shapes of row, batched so each row's edits and mask sit elsewhere.
#[test]
fn seeded_draws_give_the_host_samplers_tokens() {
    let mut gpu = test_gpu();
    let vocab: usize = 1000;
    let greedy = SamplingParams::greedy(16);
    let sets: Vec<SamplingParams> = vec![
        greedy.clone(),
        SamplingParams { repetition_penalty: 1.4, frequency_penalty: 0.3, presence_penalty: 0.2, ..greedy.clone() },
        SamplingParams { logit_bias: vec![(3, 4.0), (11, -100.0), (999, 2.5), (4000, 1.0)], ..greedy.clone() },
        SamplingParams { min_tokens: 9, stop_token_ids: vec![0, 4], ..greedy },
        random(),
        SamplingParams { temperature: 0.6, ..random() },
        SamplingParams { temperature: 1.7, ..random() },
        SamplingParams { top_k: 1, ..random() },
        SamplingParams { top_k: 20, ..random() },
        SamplingParams { top_k: 999, ..random() },
        SamplingParams { top_p: 0.9, ..random() },
        SamplingParams { top_p: 0.3, temperature: 0.8, ..random() },
        SamplingParams { top_p: 0.999, ..random() },
        SamplingParams { min_p: 0.1, ..random() },
        SamplingParams { min_p: 0.02, top_k: 40, top_p: 0.95, temperature: 0.9, ..random() },
        SamplingParams { repetition_penalty: 1.3, frequency_penalty: 0.5, presence_penalty: -0.4, ..random() },
        SamplingParams { logit_bias: vec![(3, 6.0), (50, -2.0)], top_p: 0.7, ..random() },
        SamplingParams { min_tokens: 9, stop_token_ids: vec![5], top_k: 10, ..random() },
        SamplingParams { logprobs: Some(0), ..random() },
        SamplingParams { logprobs: Some(5), top_p: 0.8, ..random() },
        SamplingParams { logprobs: Some(20), ..SamplingParams::greedy(16) },
    ];
    let mut logits = Logits(7);
    for (s, params) in sets.iter().enumerate() {
        let mut cases = Vec::new();
        let mut rows = Vec::new();
        for seed in 0..12u64 {
            let mut case = Case::new(params.clone(), seed * 7919 + s as u64);
            // Every third row under a grammar mask (allowing ids below 600
            // that are not multiples of 3): masks at scattered rows.
            if seed % 3 == 1 {
                let mask: Vec<u32> = (0..vocab.div_ceil(32))
                    .map(|w| {
                        (0..32).filter(|b| (w * 32 + b) % 3 != 0 && w * 32 + b < 600).fold(0u32, |m, b| m | 1 << b)
                    })
                    .collect();
                case.mask = Some(mask);
            }
            cases.push(case);
            rows.extend(logits.row(vocab, seed as usize % 3));
        }
        check(&mut gpu, vocab, &rows, &cases, LogprobsMode::RawLogprobs);
    }
}

#[test]
fn edge_rows_fall_back_as_the_host_does() {
    let mut gpu = test_gpu();
    let vocab = 40;
    let mut rows: Vec<f32> = Vec::new();
    let mut cases = Vec::new();
    let mut push = |row: Vec<f32>, case: Case| {
        rows.extend(row);
        cases.push(case);
    };
    let lp = |p: SamplingParams| SamplingParams { logprobs: Some(3), ..p };
    let flat = vec![0.5f32; vocab];
    // Ties everywhere: greedy takes the lowest id; top-k and top-p keep
    // ties at their boundary.
    push(flat.clone(), Case::new(lp(SamplingParams::greedy(4)), 0));
    for seed in 0..6 {
        push(flat.clone(), Case::new(SamplingParams { top_k: 3, ..random() }, seed));
        push(flat.clone(), Case::new(SamplingParams { top_p: 0.1, ..random() }, seed));
    }
    // NaN and -inf everywhere: token 0 (or the best allowed token).
    push(vec![f32::NAN; vocab], Case::new(lp(random()), 1));
    push(vec![f32::NEG_INFINITY; vocab], Case::new(lp(SamplingParams::greedy(4)), 2));
    let mut masked = Case::new(random(), 3);
    masked.mask = Some(vec![0b1000_0000, 0]);
    push(vec![f32::NEG_INFINITY; vocab], masked);
    // +inf takes the draw.
    let mut inf = vec![0.0f32; vocab];
    inf[17] = f32::INFINITY;
    inf[30] = f32::INFINITY;
    push(inf, Case::new(lp(random()), 4));
    // Only EOS allowed, EOS banned by min_tokens: the grammar wins.
    let mut eos_only = Case::new(SamplingParams { min_tokens: 50, ..random() }, 5);
    eos_only.mask = Some(vec![1 << EOS, 0]);
    push((0..vocab).map(|i| i as f32 * 0.1).collect(), eos_only);
    // A mask shorter than the row forbids the tokens past its end.
    let mut short = Case::new(SamplingParams::greedy(4), 6);
    short.mask = Some(vec![0b110]);
    push((0..vocab).map(|i| i as f32).collect(), short);
    // Fewer finite logits than top_k: top-k keeps them all.
    let mut sparse = vec![f32::NEG_INFINITY; vocab];
    sparse[3] = 1.0;
    sparse[9] = 1.5;
    push(sparse, Case::new(SamplingParams { top_k: 5, ..random() }, 7));
    check(&mut gpu, vocab, &rows, &cases, LogprobsMode::RawLogprobs);
    check(&mut gpu, vocab, &rows, &cases, LogprobsMode::RawLogits);
}

/// A vocabulary smaller than a row's threads and than its top logprobs.
#[test]
fn a_tiny_vocabulary_samples_too() {
    let mut gpu = test_gpu();
    let vocab = 5;
    let mut logits = Logits(3);
    let mut rows = Vec::new();
    let mut cases = Vec::new();
    for seed in 0..8 {
        rows.extend(logits.row(vocab, seed % 3));
        let params = SamplingParams { logprobs: Some(20), top_p: 0.9, top_k: 3, ..random() };
        cases.push(Case::new(params, seed as u64));
    }
    check(&mut gpu, vocab, &rows, &cases, LogprobsMode::RawLogprobs);
}
