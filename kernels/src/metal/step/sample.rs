//! Sampling on the GPU (sample.metal): one dispatch, one threadgroup per row,
//! draws every row's token from the logits the step left on the GPU, with
//! the host sampler's processing and draw. Only a few words per row come
//! back: the token, and what its logprobs need.
//!
//! Its buffers are allocated once, for the most rows a step samples: the
//! rows' parameters, their token edits (bans, biases and penalties, each
//! token once per row), their structured-output masks, a work row per row
//! (the processed logits, then the weights) and the output.

use super::{Access, Allocator, Encoder, Gpu, Kernel, Source, invalid, to_u32, words};
use crate::Result;

/// The most top logprobs a row reports (`kMaxTopLogprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Threads per row (`kSampleThreads`).
const THREADS: usize = 256;
/// Words each row writes (`kSampleOutWords`).
const OUT_WORDS: usize = 5 + 2 * MAX_TOP_LOGPROBS;
/// Words of `SampleParams` and of `TokenEdit`.
const PARAM_WORDS: usize = 12;
const EDIT_WORDS: usize = 4;
const NONE: u32 = u32::MAX;
/// `TokenEdit` flags (`kEditBanned`, `kEditBias`, `kEditSeen`).
const BANNED: u32 = 1;
const BIAS: u32 = 2;
const SEEN: u32 = 4;
/// Token edits a row may carry on average: a step whose rows carry more
/// (long histories under a repetition penalty) samples on the host.
pub const EDITS_PER_ROW: usize = 4096;

/// How one token's logit changes before the draw, besides the mask.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TokenEdit {
    pub token: u32,
    /// `min_tokens` bans it now (a stop id or EOS).
    pub banned: bool,
    /// Its `logit_bias`.
    pub bias: Option<f32>,
    /// It is in the prompt or the output, under a repetition penalty.
    pub seen: bool,
    /// Times generated, under a frequency or presence penalty (0 where
    /// neither applies).
    pub count: u32,
}

/// One row's sampling parameters, as the host sampler reads them.
#[derive(Clone, Copy, Debug)]
pub struct SampleRow<'a> {
    /// 0 takes the argmax.
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// The row's uniform draw in [0, 1).
    pub uniform: f64,
    /// Report the logprobs, with this many top tokens (at most
    /// [`MAX_TOP_LOGPROBS`]).
    pub top_logprobs: Option<u32>,
    /// The structured-output mask: token t may be drawn only if bit t % 32
    /// of word t / 32 is set; tokens past its end may not.
    pub allowed: Option<&'a [u32]>,
    /// Each token at most once.
    pub edits: &'a [TokenEdit],
}

impl SampleRow<'static> {
    /// The plain argmax.
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition_penalty: 1.0,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        uniform: 0.0,
        top_logprobs: None,
        allowed: None,
        edits: &[],
    };
}

/// One row's draw.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Where the row asked for them.
    pub logprobs: Option<RawLogprobs>,
}

/// What a row's logprobs derive from: its raw logits (ordered with NaN
/// read as -inf; reported as they are).
#[derive(Clone, Debug, PartialEq)]
pub struct RawLogprobs {
    /// The row's largest logit, and Σ exp(logit - max) over the row.
    pub max: f32,
    pub exp_sum: f32,
    /// The drawn token's logit.
    pub chosen: f32,
    /// The top tokens' (id, logit), most likely first, lower id first on a tie.
    pub top: Vec<(u32, f32)>,
}

impl RawLogprobs {
    /// log Σ exp(logit), in f64 as the host sampler takes it; -inf for a
    /// row with no finite logit.
    pub fn log_sum_exp(&self) -> f64 {
        self.max as f64 + (self.exp_sum as f64).ln()
    }
}

/// The sampler's buffers and kernel, built once.
#[derive(Debug)]
pub struct Sampler<B> {
    kernel: Kernel,
    vocab: usize,
    rows: usize,
    max_edits: usize,
    mask_words: usize,
    params: B,
    edits: B,
    masks: B,
    work: B,
    out: B,
}

impl<B: Clone> Sampler<B> {
    /// Buffers for up to `rows` rows of `vocab` logits.
    pub fn new<A: Allocator<Buffer = B>>(alloc: &mut A, vocab: usize, rows: usize) -> Result<Self> {
        if vocab == 0 || rows == 0 {
            return invalid(format!("a sampler for {rows} rows of {vocab} logits"));
        }
        to_u32(rows * vocab, "sampler work elements")?;
        let mask_words = vocab.div_ceil(32);
        let max_edits = rows * EDITS_PER_ROW.min(vocab);
        Ok(Self {
            kernel: Kernel { source: Source::Sample, name: "sample_rows".into(), threads: THREADS },
            vocab,
            rows,
            max_edits,
            mask_words,
            params: alloc.scratch(rows * PARAM_WORDS * 4)?,
            edits: alloc.scratch(max_edits * EDIT_WORDS * 4)?,
            masks: alloc.scratch(rows * mask_words * 4)?,
            work: alloc.scratch(rows * vocab * 4)?,
            out: alloc.scratch(rows * OUT_WORDS * 4)?,
        })
    }

    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// Whether `rows` fit the buffers: few enough rows and token edits, and
    /// top logprobs within [`MAX_TOP_LOGPROBS`].
    pub fn fits(&self, rows: &[SampleRow]) -> bool {
        rows.len() <= self.rows
            && rows.iter().map(|r| r.edits.len()).sum::<usize>() <= self.max_edits
            && rows.iter().all(|r| r.top_logprobs.is_none_or(|n| n as usize <= MAX_TOP_LOGPROBS))
    }

    /// Writes the rows' parameters, edits and masks.
    pub(super) fn write<G: Gpu<Buffer = B>>(&self, gpu: &mut G, rows: &[SampleRow]) -> Result<()> {
        if !self.fits(rows) {
            return invalid(format!(
                "{} sampling rows with {} token edits (this sampler holds {} and {}, top logprobs up to {MAX_TOP_LOGPROBS})",
                rows.len(),
                rows.iter().map(|r| r.edits.len()).sum::<usize>(),
                self.rows,
                self.max_edits
            ));
        }
        let mut params = Vec::with_capacity(rows.len() * PARAM_WORDS);
        let mut edits = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            let start = edits.len() / EDIT_WORDS;
            for e in row.edits {
                let flag = |on: bool, bit: u32| if on { bit } else { 0 };
                let flags = flag(e.banned, BANNED) | flag(e.bias.is_some(), BIAS) | flag(e.seen, SEEN);
                edits.extend([e.token, flags, e.bias.unwrap_or(0.0).to_bits(), e.count]);
            }
            if let Some(allowed) = row.allowed {
                let mut mask = vec![0u32; self.mask_words];
                let n = allowed.len().min(self.mask_words);
                mask[..n].copy_from_slice(&allowed[..n]);
                gpu.write(&self.masks, i * self.mask_words * 4, &words(&mask))?;
            }
            // The largest f32 under 1: u rounded up to 1.0 would draw past the end.
            let uniform = (row.uniform as f32).min(1.0 - f32::EPSILON / 2.0);
            params.extend([
                row.temperature.to_bits(),
                row.top_k,
                row.top_p.to_bits(),
                row.min_p.to_bits(),
                row.repetition_penalty.to_bits(),
                row.frequency_penalty.to_bits(),
                row.presence_penalty.to_bits(),
                uniform.to_bits(),
                start as u32,
                row.edits.len() as u32,
                if row.allowed.is_some() { i as u32 } else { NONE },
                row.top_logprobs.unwrap_or(NONE),
            ]);
        }
        gpu.write(&self.params, 0, &words(&params))?;
        if !edits.is_empty() {
            gpu.write(&self.edits, 0, &words(&edits))?;
        }
        Ok(())
    }

    /// The dispatch drawing `rows` rows of `logits` (`[rows, vocab]` f32).
    pub(super) fn encode<E: Encoder<Buffer = B>>(&self, enc: &mut E, logits: &B, rows: usize) {
        enc.set_kernel(&self.kernel);
        enc.set_buffer(0, logits, 0, Access::Read);
        enc.set_buffer(1, &self.work, 0, Access::Write);
        enc.set_buffer(2, &self.params, 0, Access::Read);
        enc.set_buffer(3, &self.edits, 0, Access::Read);
        enc.set_buffer(4, &self.masks, 0, Access::Read);
        enc.set_buffer(5, &self.out, 0, Access::Write);
        enc.set_bytes(6, &words(&[self.vocab as u32, self.mask_words as u32]));
        enc.dispatch([rows, 1, 1], [THREADS, 1, 1]);
    }

    /// The draws of the rows written last.
    pub(super) fn read<G: Gpu<Buffer = B>>(&self, gpu: &mut G, rows: &[SampleRow]) -> Result<Vec<Sampled>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut bytes = vec![0u8; rows.len() * OUT_WORDS * 4];
        gpu.read(&self.out, 0, &mut bytes)?;
        let out: Vec<u32> = bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Ok(rows
            .iter()
            .zip(out.chunks_exact(OUT_WORDS))
            .map(|(row, o)| Sampled {
                token: o[0],
                logprobs: row.top_logprobs.map(|_| RawLogprobs {
                    max: f32::from_bits(o[2]),
                    exp_sum: f32::from_bits(o[3]),
                    chosen: f32::from_bits(o[4]),
                    top: (0..o[1] as usize).map(|r| (o[5 + 2 * r], f32::from_bits(o[6 + 2 * r]))).collect(),
                }),
            })
            .collect())
    }

    /// Draws `rows` of `logits` (`[rows, vocab]` f32, on the GPU) in a
    /// command buffer of its own.
    pub fn sample<G: Gpu<Buffer = B>>(&self, gpu: &mut G, logits: &B, rows: &[SampleRow]) -> Result<Vec<Sampled>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        self.write(gpu, rows)?;
        let mut enc = gpu.begin();
        self.encode(&mut enc, logits, rows.len());
        gpu.commit_and_wait(enc)?;
        self.read(gpu, rows)
    }
}
