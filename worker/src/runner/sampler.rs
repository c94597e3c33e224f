//! The batched sampler: one row of logits per sequence, each with its own
//! `SamplingParams`, to one token each. Follows vLLM v1's `Sampler`, on the
//! host.
//!
//! Per row, in vLLM's order: the structured-output mask (tokens the
//! request's grammar forbids get -inf, before anything else), min_tokens masking (stop ids, EOS), logit
//! bias, repetition penalty (prompt + output), frequency and presence
//! penalties (output), then either greedy argmax or temperature, min-p,
//! top-k, top-p and one draw. Log-probabilities are those of the raw model logits (vLLM's default
//! `raw_logprobs`) and are computed only for requests that ask for them.
//!
//! Determinism: a request's draw is a pure function of its seed and of how
//! many tokens it has generated; no RNG state lives between steps. Its output
//! thus does not depend on the rest of the batch, and a request preempted and
//! recomputed draws the same tokens again.
//!
//! Cost: rows run in parallel with per-thread scratch buffers. Greedy rows
//! without penalties are one pass over the raw row; sampling rows take one
//! `exp` per token. Only top-p sorts, and only the tokens that can be in the
//! nucleus.

use std::borrow::Cow;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use common::{SampledToken, SamplingParams};
use rayon::prelude::*;

use super::logprobs::{LogprobsMode, reported_logprobs};

/// One row of sampling logits as both samplers read it (the host's loops
/// and the device's tensor columns): built once per step by the engine, or
/// by a pipeline's last stage from the step's `SequenceSampling`s.
#[derive(Clone, Copy, Debug)]
pub struct SamplingRow<'a> {
    pub params: &'a SamplingParams,
    /// Read by the repetition penalty only (a pipeline's last stage gets
    /// it only then).
    pub prompt_token_ids: &'a [u32],
    /// Tokens generated so far, read by the penalties only.
    pub output_token_ids: &'a [u32],
    /// How many tokens were generated so far (`min_tokens`, the seeded
    /// draw's position): `output_token_ids.len()` where that is complete.
    pub num_output_tokens: usize,
    /// Seed of this request's random stream (from `params.seed`, or drawn by
    /// the engine when the request arrived).
    pub seed: u64,
    /// Ids that end generation by default (EOS); masked until `min_tokens`
    /// tokens were generated, unless `params.ignore_eos`.
    pub eos_token_ids: &'a [u32],
    /// The structured-output mask: token t may be drawn only if bit t % 32
    /// of word t / 32 is set (llguidance's layout). It beats `min_tokens`:
    /// when the grammar allows only EOS, EOS it is.
    pub allowed: Option<&'a [u32]>,
}

impl SamplingRow<'_> {
    /// The row's uniform draw in [0, 1): its request's stream at this
    /// position, the same on the host and on the device.
    pub fn uniform(&self) -> f64 {
        step_uniform(self.seed, self.num_output_tokens as u64)
    }

    /// Ids `min_tokens` forbids now: the stop ids, and EOS unless
    /// `ignore_eos`, until `min_tokens` tokens were generated.
    pub fn banned_now(&self) -> impl Iterator<Item = u32> + '_ {
        let p = self.params;
        let active = self.num_output_tokens < p.min_tokens as usize;
        let eos = if p.ignore_eos { &[][..] } else { self.eos_token_ids };
        p.stop_token_ids.iter().chain(eos).copied().filter(move |_| active)
    }
}

/// One row's draw before its logprobs are reported ([`sample_batch`]
/// turns it into a `SampledToken`).
#[derive(Clone, Debug, PartialEq)]
pub struct Draw {
    pub token_id: u32,
    /// Raw log-probability of the chosen token; NaN unless `params.logprobs`
    /// is set (computing it costs a pass of `exp` over the vocabulary).
    pub logprob: f32,
    /// The `params.logprobs` most likely tokens by raw log-probability, most
    /// likely first, lower id first on a tie.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The output the sampler sees at each of the `1 + proposed.len()` rows
/// of a sequence verifying `proposed` after `output`: row i takes the
/// first i proposals as generated, so its penalties (and, with the output
/// count, `min_tokens` and the seeded draw) are plain decoding's there.
pub fn verified_outputs<'a>(output: &'a [u32], proposed: &'a [u32]) -> impl Iterator<Item = Cow<'a, [u32]>> {
    let guessed = (1..=proposed.len()).map(move |i| Cow::Owned([output, &proposed[..i]].concat()));
    std::iter::once(Cow::Borrowed(output)).chain(guessed)
}

/// Samples one token per sequence. `logits` is row-major
/// `[seqs.len(), vocab_size]`.
pub fn sample_batch(logits: &[f32], vocab_size: usize, seqs: &[SamplingRow], mode: LogprobsMode) -> Vec<SampledToken> {
    if seqs.is_empty() {
        return Vec::new();
    }
    assert!(vocab_size > 0 && logits.len() == seqs.len() * vocab_size, "one row of {vocab_size} logits per sequence");
    logits
        .par_chunks_exact(vocab_size)
        .zip(seqs)
        .map_init(Scratch::default, |scratch, (raw, seq)| {
            let Draw { token_id, logprob, top_logprobs } = sample_row(raw, seq, scratch);
            let asked = seq.params.logprobs.is_some();
            let logprobs = asked.then(|| reported_logprobs(mode, raw, token_id, logprob, top_logprobs));
            SampledToken { token_id, logprobs }
        })
        .collect()
}

/// Log-probability of one given token per row, plus the row's `n` most
/// likely tokens: `rows[i] = (token, n)` for row i of `logits` (row-major,
/// `vocab_size` wide). Used for prompt logprobs, with the same numbers as
/// a sampled token's.
pub fn token_logprobs(logits: &[f32], vocab_size: usize, rows: &[(u32, usize)]) -> Vec<(f32, Vec<(u32, f32)>)> {
    assert!(vocab_size > 0 && logits.len() == rows.len() * vocab_size, "one row of {vocab_size} logits per token");
    logits.par_chunks_exact(vocab_size).zip(rows).map(|(raw, &(token, n))| raw_logprobs(raw, token, n)).collect()
}

/// Buffers reused across the rows one rayon worker handles.
#[derive(Default)]
struct Scratch {
    /// The processed row: logits, then sampling weights.
    row: Vec<f32>,
    /// Top-p candidates as (weight, id).
    cand: Vec<(f32, u32)>,
    /// The k largest logits seen so far, for top-k.
    heap: BinaryHeap<Reverse<TotalF32>>,
    /// Sorted output ids, to count repeats.
    ids: Vec<u32>,
}

/// Whether a row's token is the plain argmax of its logits: greedy, with
/// nothing that changes the logits first (no `min_tokens` ban, penalty,
/// bias or grammar mask).
pub fn is_plain_argmax(p: &SamplingParams, num_output_tokens: usize, constrained: bool) -> bool {
    let masks_stops = num_output_tokens < p.min_tokens as usize;
    let penalises = p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
    p.is_greedy() && !masks_stops && !penalises && p.logit_bias.is_empty() && !constrained
}

fn sample_row(raw: &[f32], seq: &SamplingRow, s: &mut Scratch) -> Draw {
    let p = seq.params;
    let masks_stops = seq.num_output_tokens < p.min_tokens as usize;
    let penalises = p.repetition_penalty != 1.0 || p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
    let token = if is_plain_argmax(p, seq.num_output_tokens, seq.allowed.is_some()) {
        argmax(raw)
    } else {
        s.row.clear();
        s.row.extend(raw.iter().map(|&x| clean(x)));
        if let Some(allowed) = seq.allowed {
            apply_allowed(&mut s.row, allowed);
        }
        if masks_stops {
            apply_min_tokens(&mut s.row, seq);
        }
        for &(t, b) in &p.logit_bias {
            // Ids come from the request: ignore those outside the vocabulary.
            if let Some(x) = s.row.get_mut(t as usize) {
                *x += b;
            }
        }
        if penalises {
            apply_penalties(&mut s.row, raw, seq, &mut s.ids);
        }
        if p.is_greedy() {
            argmax(&s.row)
        } else {
            let u = step_uniform(seq.seed, seq.num_output_tokens as u64);
            let mut row = std::mem::take(&mut s.row);
            let token = draw(&mut row, p, u, s);
            s.row = row;
            token
        }
    };
    // Everything masked (all -inf or NaN): the most likely token the
    // grammar allows, else the raw argmax, else token 0.
    let token_id = token.or_else(|| best_allowed(raw, seq.allowed)).or_else(|| argmax(raw)).unwrap_or(0);
    let (logprob, top_logprobs) = match p.logprobs {
        Some(n) => raw_logprobs(raw, token_id, n as usize),
        None => (f32::NAN, Vec::new()),
    };
    Draw { token_id, logprob, top_logprobs }
}

/// NaN logits count as impossible tokens.
fn clean(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x }
}

fn apply_min_tokens(row: &mut [f32], seq: &SamplingRow) {
    let eos = if seq.params.ignore_eos { &[][..] } else { seq.eos_token_ids };
    for &t in seq.params.stop_token_ids.iter().chain(eos) {
        // Ids come from the request: ignore those outside the vocabulary.
        if let Some(x) = row.get_mut(t as usize) {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// Sets every token the bitmask `allowed` forbids to -inf (and all tokens
/// past its end).
fn apply_allowed(row: &mut [f32], allowed: &[u32]) {
    for (chunk, &word) in row.chunks_mut(32).zip(allowed.iter().chain(std::iter::repeat(&0))) {
        if word == u32::MAX {
            continue;
        }
        for (bit, x) in chunk.iter_mut().enumerate() {
            if word & (1 << bit) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// The allowed token with the largest raw logit (lowest id on a tie), even
/// when every logit is -inf or NaN; `None` without a mask or if it allows nothing.
fn best_allowed(raw: &[f32], allowed: Option<&[u32]>) -> Option<u32> {
    let allowed = allowed?;
    let is_allowed = |t: usize| allowed.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0);
    let mut best: Option<(usize, f32)> = None;
    for (t, &x) in raw.iter().enumerate().filter(|&(t, _)| is_allowed(t)) {
        let x = clean(x);
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((t, x));
        }
    }
    best.map(|(t, _)| t as u32)
}

/// vLLM's `apply_penalties`: repetition over prompt and output, then
/// `logit -= frequency * count` and `logit -= presence * (count > 0)` over
/// the output.
fn apply_penalties(row: &mut [f32], raw: &[f32], seq: &SamplingRow, ids: &mut Vec<u32>) {
    let p = seq.params;
    if p.repetition_penalty != 1.0 {
        for &t in seq.prompt_token_ids.iter().chain(seq.output_token_ids) {
            let t = t as usize;
            // Recomputed from the (biased) raw logit rather than scaled in
            // place, so a token seen many times is penalised once without a
            // seen-set; tokens masked by min_tokens stay -inf.
            if let Some(x) = row.get_mut(t).filter(|x| **x != f32::NEG_INFINITY) {
                let r = clean(raw[t]) + p.bias_of(t as u32);
                *x = if r > 0.0 { r / p.repetition_penalty } else { r * p.repetition_penalty };
            }
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        ids.clear();
        ids.extend_from_slice(seq.output_token_ids);
        ids.sort_unstable();
        for run in ids.chunk_by(|a, b| a == b) {
            if let Some(x) = row.get_mut(run[0] as usize) {
                *x -= p.frequency_penalty * run.len() as f32;
                *x -= p.presence_penalty;
            }
        }
    }
}

/// Index of the largest value, the lowest on a tie; NaN and -inf never win.
/// `None` if nothing else is left.
fn argmax(row: &[f32]) -> Option<u32> {
    let max = max_value(row);
    if max == f32::NEG_INFINITY {
        return None;
    }
    row.iter().position(|&x| x == max).map(|i| i as u32)
}

/// Largest value, NaN ignored. Eight independent lanes let the compiler
/// vectorise what a single running maximum would serialise.
fn max_value(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// Temperature, min-p, top-k, top-p, then the token whose cumulative weight
/// first exceeds `u` times the kept total. `row` holds the processed logits
/// (no NaN) and is overwritten with the weights.
fn draw(row: &mut [f32], p: &SamplingParams, u: f64, s: &mut Scratch) -> Option<u32> {
    let Scratch { cand, heap, .. } = s;
    let max = max_value(row);
    if max == f32::NEG_INFINITY {
        return None;
    }
    if max == f32::INFINITY {
        // exp(inf - inf) is NaN; an infinite logit takes all the mass anyway.
        return argmax(row);
    }
    // Top-k keeps every token at least as likely as the k-th (ties at the
    // boundary too, as vLLM does), so it is a threshold on the logit.
    let k = p.top_k as usize;
    let kth = if k > 0 && k < row.len() { kth_largest(row, k, heap) } else { f32::NEG_INFINITY };
    // Weights relative to the top token, exp((x - max) / T), so the top one
    // weighs 1 and min-p (p_i >= min_p * p_max) is a floor on the weight.
    // Min-p and top-k are both thresholds below the top token, so their
    // order does not matter; top-p renormalises and must come after both.
    let inv_t = 1.0 / p.temperature;
    for x in row.iter_mut() {
        let w = exp_nonpositive((*x - max) * inv_t);
        *x = if (*x >= kth) & (w >= p.min_p) { w } else { 0.0 };
    }
    let total = lane_sum(row, |w| w);
    if p.top_p < 1.0 {
        let (kept, kept_total) = nucleus(row, total, p.top_p as f64, cand);
        return walk(kept.iter().map(|c| (c.1, c.0)), u * kept_total);
    }
    walk(row.iter().enumerate().map(|(i, &w)| (i as u32, w)), u * total)
}

/// Σ f(x) in f64, over eight lanes so that `f` and the sum vectorise.
fn lane_sum(row: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut lanes = [0.0f64; 8];
    let chunks = row.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&x| f(x) as f64).sum();
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += f(x) as f64;
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// The k-th largest finite value, or -inf if there are at most k: one pass
/// that mostly compares against the smallest of the k best so far.
fn kth_largest(row: &[f32], k: usize, heap: &mut BinaryHeap<Reverse<TotalF32>>) -> f32 {
    heap.clear();
    for &x in row.iter().filter(|x| **x > f32::NEG_INFINITY) {
        if heap.len() < k {
            heap.push(Reverse(TotalF32(x)));
        } else if let Some(mut least) = heap.peek_mut().filter(|least| x > least.0.0) {
            *least = Reverse(TotalF32(x));
        }
    }
    match heap.peek() {
        Some(least) if heap.len() == k => least.0.0,
        _ => f32::NEG_INFINITY,
    }
}

/// An `f32` ordered by `total_cmp`, for the top-k heap.
#[derive(Clone, Copy, Debug, PartialEq)]
struct TotalF32(f32);

impl Eq for TotalF32 {}

impl PartialOrd for TotalF32 {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for TotalF32 {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// e^x for x <= 0 (to about 2 ulp), 0 below -87 and for -inf. Cephes'
/// `expf` without branches, so the weight loop vectorises; and, unlike the
/// platform's libm, the same bits everywhere, so seeded draws agree across
/// machines.
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer n, which then sits
    // in the low mantissa bits: t's bits are 0x4B40_0000 + n.
    const ROUND: f32 = 12_582_912.0;
    let xc = if x > -87.0 { x } else { -87.0 };
    let t = xc * LOG2_E + ROUND;
    let n = t - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut y = 1.987_569_1e-4;
    for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
        y = y * r + c;
    }
    let y = y * r * r + r + 1.0;
    // 2^n, n in [-126, 0] so a normal float: exponent field n + 127.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    if x < -87.0 { 0.0 } else { y * scale }
}

/// The smallest prefix, most likely first (lower id on a tie), whose weight
/// reaches `top_p * total`, and that prefix's weight. Sorts only the tokens
/// above a floor, lowering the floor until the tokens above it hold enough
/// mass; those are then a prefix of the full order and hold the nucleus.
fn nucleus<'c>(weights: &[f32], total: f64, top_p: f64, cand: &'c mut Vec<(f32, u32)>) -> (&'c [(f32, u32)], f64) {
    let target = top_p * total;
    for floor in [1e-3, 1e-6, 1e-12, f32::MIN_POSITIVE, 0.0] {
        cand.clear();
        cand.extend(weights.iter().enumerate().filter(|(_, w)| **w >= floor && **w > 0.0).map(|(i, &w)| (w, i as u32)));
        let mass: f64 = cand.iter().map(|c| c.0 as f64).sum();
        if mass >= target || floor == 0.0 {
            break;
        }
    }
    cand.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut cum = 0.0f64;
    let mut len = cand.len();
    for (i, c) in cand.iter().enumerate() {
        cum += c.0 as f64;
        if cum >= target {
            len = i + 1;
            break;
        }
    }
    (&cand[..len], cum)
}

/// The first token whose cumulative weight exceeds `target`; the last one
/// with weight if rounding leaves `target` past the end.
fn walk(weights: impl Iterator<Item = (u32, f32)>, target: f64) -> Option<u32> {
    let mut cum = 0.0f64;
    let mut last = None;
    for (id, w) in weights {
        if w > 0.0 {
            cum += w as f64;
            last = Some(id);
            if target < cum {
                break;
            }
        }
    }
    last
}

/// The chosen token's raw log-probability and the `n` most likely tokens.
fn raw_logprobs(raw: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = max_value(raw);
    let sum = lane_sum(raw, |x| exp_nonpositive(clean(x) - max));
    let lse = max as f64 + sum.ln();
    // A row with no finite logit has no distribution: call it all -inf.
    let logprob = |x: f32| {
        let lp = (clean(x) as f64 - lse) as f32;
        if lp.is_nan() { f32::NEG_INFINITY } else { lp }
    };
    let chosen = raw.get(token as usize).map_or(f32::NEG_INFINITY, |&x| logprob(x));
    // A small sorted list; past the first n most tokens fail the first test.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &x) in raw.iter().enumerate() {
            let x = clean(x);
            if top.len() == n && x <= top[n - 1].1 {
                continue;
            }
            // After equal values: ids arrive ascending, so the lower stays first.
            let pos = top.partition_point(|&(_, v)| v >= x);
            top.insert(pos, (i as u32, x));
            top.truncate(n);
        }
    }
    (chosen, top.into_iter().map(|(i, x)| (i, logprob(x))).collect())
}

/// The uniform draw in [0, 1) of the request seeded `seed` after `step`
/// generated tokens: SplitMix64 seeded by both, hashed apart first so that
/// nearby seeds and steps give unrelated streams.
pub(crate) fn step_uniform(seed: u64, step: u64) -> f64 {
    let bits = splitmix64(seed ^ splitmix64(step));
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

/// One step of SplitMix64 (Steele, Lea, Flood 2014) from state `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A reported token as the tests read a draw: NaN and no top list where
/// no logprobs were asked for.
#[cfg(test)]
pub fn as_draw(s: SampledToken) -> Draw {
    let (logprob, top_logprobs) = s.logprobs.map_or((f32::NAN, Vec::new()), |l| (l.logprob, l.top));
    Draw { token_id: s.token_id, logprob, top_logprobs }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 2;

    fn input<'a>(params: &'a SamplingParams, prompt: &'a [u32], output: &'a [u32], seed: u64) -> SamplingRow<'a> {
        SamplingRow {
            params,
            prompt_token_ids: prompt,
            output_token_ids: output,
            num_output_tokens: output.len(),
            seed,
            eos_token_ids: &[EOS],
            allowed: None,
        }
    }

    fn sample(logits: &[f32], params: &SamplingParams, output: &[u32], seed: u64) -> Draw {
        as_draw(sample_batch(logits, logits.len(), &[input(params, &[], output, seed)], RAW).remove(0))
    }

    const RAW: LogprobsMode = LogprobsMode::RawLogprobs;

    fn greedy() -> SamplingParams {
        SamplingParams::greedy(16)
    }

    /// Default params (temperature 1) with one field changed.
    fn random() -> SamplingParams {
        SamplingParams::default()
    }

    #[test]
    fn greedy_takes_the_argmax_and_the_lowest_id_on_ties() {
        assert_eq!(sample(&[0.1, 3.0, 3.0, -1.0], &greedy(), &[], 0).token_id, 1);
        assert_eq!(sample(&[-5.0, -4.0, -4.5], &greedy(), &[], 0).token_id, 1);
        // Also through the processed-row path (a no-op penalty forces it).
        let p = SamplingParams { presence_penalty: 0.5, ..greedy() };
        assert_eq!(sample(&[0.1, 3.0, 3.0, -1.0], &p, &[0], 0).token_id, 1);
    }

    #[test]
    fn a_grammar_mask_limits_every_draw_and_beats_min_tokens() {
        // Tokens 1 and 33 of 40 allowed: bits 1 of word 0 and 1 of word 1.
        let allowed = [0b10, 0b10];
        let mut logits = vec![0.0f32; 40];
        logits[5] = 9.0;
        logits[33] = -3.0;
        for (params, seed) in
            [(greedy(), 0), (random(), 1), (random(), 2), (SamplingParams { top_k: 1, ..random() }, 3)]
        {
            for seed in seed..seed + 20 {
                let seq = SamplingRow { allowed: Some(&allowed), ..input(&params, &[], &[], seed) };
                let t = sample_batch(&logits, 40, &[seq], RAW).remove(0).token_id;
                assert!(t == 1 || t == 33, "drew {t}");
            }
        }
        // Only EOS allowed, EOS banned by min_tokens: the grammar wins.
        let p = SamplingParams { min_tokens: 5, ..random() };
        let eos_only = [1 << EOS];
        let seq = SamplingRow { allowed: Some(&eos_only), ..input(&p, &[], &[], 0) };
        assert_eq!(sample_batch(&[1.0, 2.0, 0.0, 3.0], 4, &[seq], RAW).remove(0).token_id, EOS);
        // A mask shorter than the row forbids the tokens past its end.
        let params = greedy();
        let seq = SamplingRow { allowed: Some(&[0b1]), ..input(&params, &[], &[], 0) };
        assert_eq!(sample_batch(&logits, 40, &[seq], RAW).remove(0).token_id, 0);
    }

    #[test]
    fn nan_and_masked_rows_do_not_panic() {
        assert_eq!(sample(&[f32::NAN, 0.5, f32::NAN], &greedy(), &[], 0).token_id, 1);
        assert_eq!(sample(&[f32::NAN, 0.5, f32::NAN], &random(), &[], 7).token_id, 1);
        let lp = SamplingParams { logprobs: Some(3), ..random() };
        let s = sample(&[f32::NAN; 3], &lp, &[], 0);
        assert_eq!(s.token_id, 0);
        assert_eq!(s.top_logprobs.len(), 3);
        // Everything masked by min_tokens: the raw argmax, EOS here.
        let p = SamplingParams { min_tokens: 1, stop_token_ids: vec![0, 1, 99], ..random() };
        assert_eq!(sample(&[1.0, 2.0, 3.0], &p, &[], 0).token_id, 2);
        // Infinite logits.
        assert_eq!(sample(&[0.0, f32::INFINITY, 1.0], &random(), &[], 0).token_id, 1);
        assert_eq!(sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0], &random(), &[], 0).token_id, 2);
    }

    fn test_row(n: usize, salt: u32) -> Vec<f32> {
        (0..n as u32).map(|i| ((i * 7 + salt * 13) % 17) as f32 * 0.25).collect()
    }

    #[test]
    fn a_draw_does_not_depend_on_the_rest_of_the_batch() {
        let v = 64;
        let p = SamplingParams { temperature: 0.9, top_p: 0.95, logprobs: Some(5), ..random() };
        let others = [
            greedy(),
            SamplingParams { top_k: 5, ..random() },
            SamplingParams { temperature: 1.5, min_p: 0.1, ..random() },
            SamplingParams { repetition_penalty: 1.3, frequency_penalty: 0.5, ..random() },
            SamplingParams { logprobs: Some(4), ..random() },
            SamplingParams { min_tokens: 3, stop_token_ids: vec![1], ..random() },
            SamplingParams { temperature: 0.2, ..random() },
        ];
        for seed in 0..50 {
            let output = [5, 6, 7];
            let alone = sample_batch(&test_row(v, 0), v, &[input(&p, &[1, 2], &output, seed)], RAW);
            let mut logits = Vec::new();
            let mut batch = Vec::new();
            for j in 0..8 {
                if j == 3 {
                    logits.extend(test_row(v, 0));
                    batch.push(input(&p, &[1, 2], &output, seed));
                } else {
                    let o = &others[j.min(others.len() - 1)];
                    logits.extend(test_row(v, j as u32 + 1));
                    batch.push(input(o, &[3], &output[..j % 3], seed + j as u64));
                }
            }
            assert_eq!(sample_batch(&logits, v, &batch, RAW)[3], alone[0], "seed {seed}");
        }
    }

    #[test]
    fn the_stream_is_a_function_of_seed_and_position() {
        let logits = test_row(100, 1);
        let p = random();
        let zeros = [0u32; 64];
        let draws = |seed| (0..64).map(|k| sample(&logits, &p, &zeros[..k], seed).token_id).collect::<Vec<_>>();
        assert_eq!(draws(42), draws(42));
        let d = draws(42);
        // Different positions and different seeds give different streams.
        assert!(d.iter().filter(|&&t| t != d[0]).count() > 32, "{d:?}");
        assert_ne!(d, draws(43));
        // Only the output's length matters, not its contents.
        assert_eq!(sample(&logits, &p, &[9, 9, 9], 42).token_id, d[3]);
    }

    #[test]
    fn filters_reduce_to_greedy_at_their_limits() {
        let logits = [1.0, 2.5, 0.3, 2.4];
        for p in [
            SamplingParams { top_k: 1, ..random() },
            SamplingParams { top_p: 1e-6, ..random() },
            SamplingParams { min_p: 1.0, ..random() },
            SamplingParams { top_k: 1, temperature: 5.0, ..random() },
        ] {
            for seed in 0..50 {
                assert_eq!(sample(&logits, &p, &[], seed).token_id, 1, "{p:?}");
            }
        }
        // top_k beyond the vocabulary is no filter.
        let p = SamplingParams { top_k: 1000, ..random() };
        let seen: std::collections::HashSet<u32> = (0..200).map(|s| sample(&logits, &p, &[], s).token_id).collect();
        assert_eq!(seen.len(), 4);
    }

    /// Which tokens a filter lets through, over many draws.
    fn reachable(logits: &[f32], p: &SamplingParams) -> Vec<u32> {
        let mut seen: Vec<u32> = (0..2000).map(|s| sample(logits, p, &[], s).token_id).collect();
        seen.sort_unstable();
        seen.dedup();
        seen
    }

    #[test]
    fn filters_keep_the_documented_sets() {
        // p = 0.4, 0.3, 0.2, 0.1 at temperature 1.
        let logits = [0.4f32.ln(), 0.3f32.ln(), 0.2f32.ln(), 0.1f32.ln()];
        assert_eq!(reachable(&logits, &SamplingParams { top_k: 2, ..random() }), [0, 1]);
        // min_p 0.4: p >= 0.16 survive, 0.1 does not.
        assert_eq!(reachable(&logits, &SamplingParams { min_p: 0.4, ..random() }), [0, 1, 2]);
        // top_p 0.65: 0.4 + 0.3 reaches it; 0.75 needs the third token.
        assert_eq!(reachable(&logits, &SamplingParams { top_p: 0.65, ..random() }), [0, 1]);
        assert_eq!(reachable(&logits, &SamplingParams { top_p: 0.75, ..random() }), [0, 1, 2]);
        // min_p renormalises before top_p (vLLM's order): 0.4/0.9 + 0.3/0.9 >= 0.75.
        assert_eq!(reachable(&logits, &SamplingParams { min_p: 0.4, top_p: 0.75, ..random() }), [0, 1]);
        // Top-k keeps ties at its boundary.
        assert_eq!(reachable(&[1.0, 3.0, 2.0, 2.0], &SamplingParams { top_k: 2, ..random() }), [1, 2, 3]);
    }

    #[test]
    fn draws_follow_the_distribution() {
        let logits = [0.0f32, 2.0f32.ln(), 7.0f32.ln()]; // p = 0.1, 0.2, 0.7
        let n = 20_000;
        let zeros = vec![0u32; n];
        for (seed, p) in [(1, random()), (2, SamplingParams { top_p: 0.99, ..random() })] {
            let mut counts = [0usize; 3];
            for k in 0..n {
                counts[sample(&logits, &p, &zeros[..k], seed).token_id as usize] += 1;
            }
            for (c, want) in counts.iter().zip([0.1, 0.2, 0.7]) {
                assert!((*c as f64 / n as f64 - want).abs() < 0.015, "{counts:?}");
            }
        }
        // Temperature 2 flattens to p ∝ sqrt(1, 2, 7).
        let p = SamplingParams { temperature: 2.0, ..random() };
        let mut counts = [0usize; 3];
        for k in 0..n {
            counts[sample(&logits, &p, &zeros[..k], 3).token_id as usize] += 1;
        }
        let z = 1.0 + 2f64.sqrt() + 7f64.sqrt();
        for (c, want) in counts.iter().zip([1.0 / z, 2f64.sqrt() / z, 7f64.sqrt() / z]) {
            assert!((*c as f64 / n as f64 - want).abs() < 0.015, "{counts:?}");
        }
    }

    #[test]
    fn top_p_over_a_large_flat_tail_matches_a_full_sort() {
        // 40,000 tokens: a few likely ones and a long tail holding real mass,
        // so the nucleus search must lower its floor.
        let v = 40_000;
        let logits: Vec<f32> = (0..v).map(|i| if i % 9_999 == 0 { 8.0 } else { -((i % 13) as f32) }).collect();
        for top_p in [0.3, 0.9, 0.999] {
            let p = SamplingParams { top_p, ..random() };
            let mut w: Vec<(f32, u32)> = logits.iter().enumerate().map(|(i, &x)| ((x - 8.0).exp(), i as u32)).collect();
            let total: f64 = w.iter().map(|c| c.0 as f64).sum();
            w.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut cum = 0.0;
            let len = w.iter().position(|c| {
                cum += c.0 as f64;
                cum >= top_p as f64 * total
            });
            let kept: std::collections::HashSet<u32> = w[..=len.unwrap()].iter().map(|c| c.1).collect();
            for seed in 0..300 {
                let t = sample(&logits, &p, &[], seed).token_id;
                assert!(kept.contains(&t), "top_p {top_p}: {t} not in the nucleus");
            }
        }
    }

    #[test]
    fn penalties_change_logits_as_specified() {
        // Repetition divides a positive logit: 3 / 2 = 1.5 < 2, once however often seen.
        let rep = SamplingParams { repetition_penalty: 2.0, ..greedy() };
        let pick = |logits: &[f32], p: &SamplingParams, prompt: &[u32], output: &[u32]| {
            sample_batch(logits, logits.len(), &[input(p, prompt, output, 0)], RAW)[0].token_id
        };
        assert_eq!(pick(&[3.0, 2.0], &rep, &[0], &[]), 1);
        assert_eq!(pick(&[3.0, 1.6], &rep, &[0, 0], &[0, 0]), 1);
        assert_eq!(pick(&[3.0, 1.4], &rep, &[0, 0], &[0, 0]), 0);
        // ... and multiplies a negative one: -1 * 2 = -2 < -1.5.
        assert_eq!(pick(&[-1.0, -1.5], &rep, &[], &[0]), 1);
        // Prompt tokens get no frequency or presence penalty.
        let freq = SamplingParams { frequency_penalty: 0.4, ..greedy() };
        assert_eq!(pick(&[3.0, 2.0], &freq, &[0, 0, 0, 0], &[]), 0);
        // Frequency per occurrence: 3 - 0.4 * 3 = 1.8 < 2; after two, 2.2 > 2.
        assert_eq!(pick(&[3.0, 2.0], &freq, &[], &[0, 0, 0]), 1);
        assert_eq!(pick(&[3.0, 2.0], &freq, &[], &[0, 0]), 0);
        // Presence once: 3 - 0.5 = 2.5 > 2 however often; 3 - 1.1 = 1.9 < 2.
        let pres = |x| SamplingParams { presence_penalty: x, ..greedy() };
        assert_eq!(pick(&[3.0, 2.0], &pres(0.5), &[], &[0, 0, 0, 0, 0]), 0);
        assert_eq!(pick(&[3.0, 2.0], &pres(1.1), &[], &[0]), 1);
        // All three: (3 / 1.25) - 0.1 * 2 - 0.3 = 1.9 < 1.95; out-of-vocab ids are ignored.
        let all =
            SamplingParams { repetition_penalty: 1.25, frequency_penalty: 0.1, presence_penalty: 0.3, ..greedy() };
        assert_eq!(pick(&[3.0, 1.95], &all, &[0, 77], &[0, 0, 99]), 1);
        assert_eq!(pick(&[3.0, 1.85], &all, &[0, 77], &[0, 0, 99]), 0);
    }

    #[test]
    fn logit_bias_shifts_tokens_before_the_penalties() {
        let logits = [3.0, 2.0, 1.0];
        let bias = |b: Vec<(u32, f32)>| SamplingParams { logit_bias: b, ..greedy() };
        assert_eq!(sample(&logits, &bias(vec![(2, 2.5)]), &[], 0).token_id, 2);
        assert_eq!(sample(&logits, &bias(vec![(0, -100.0)]), &[], 0).token_id, 1);
        // Out-of-vocabulary ids are ignored.
        assert_eq!(sample(&logits, &bias(vec![(1, 0.5), (99, 100.0)]), &[], 0).token_id, 0);
        // A banned token is never drawn, whatever the seed.
        let r = SamplingParams { logit_bias: vec![(0, -100.0)], ..random() };
        assert!((0..300).all(|s| sample(&[1.0, 1.0, 1.0], &r, &[], s).token_id != 0));
        // The repetition penalty divides the biased logit, as in vLLM:
        // (1 + 2) / 2 = 1.5 < 2 wins for token 1; after biasing 3 + 2 = 5,
        // 5 / 2 = 2.5 > 2 for token 0.
        let rep = |b: Vec<(u32, f32)>| SamplingParams { repetition_penalty: 2.0, logit_bias: b, ..greedy() };
        let pick = |p: &SamplingParams| sample_batch(&[1.0, 2.0], 2, &[input(p, &[0], &[], 0)], RAW)[0].token_id;
        assert_eq!(pick(&rep(vec![(0, 2.0)])), 1);
        assert_eq!(pick(&rep(vec![(0, 4.0)])), 0);
        // Logprobs stay those of the raw logits.
        let lp = SamplingParams { logprobs: Some(0), ..bias(vec![(2, 2.5)]) };
        let got = sample(&logits, &lp, &[], 0);
        let want = 1.0 - (3f32.exp() + 2f32.exp() + 1f32.exp()).ln();
        assert!((got.token_id, (got.logprob - want).abs() < 1e-5) == (2, true), "{got:?}");
    }

    #[test]
    fn min_tokens_suppresses_eos_and_stop_ids() {
        let p = SamplingParams { min_tokens: 2, stop_token_ids: vec![3], ..greedy() };
        let logits = [0.0, 1.0, 5.0, 4.0]; // EOS (2), then stop id 3, are best
        assert_eq!(sample(&logits, &p, &[1], 0).token_id, 1);
        assert_eq!(sample(&logits, &p, &[1, 1], 0).token_id, 2);
        // With ignore_eos, EOS is an ordinary token; only the stop id is masked.
        let ignore = SamplingParams { ignore_eos: true, ..p.clone() };
        assert_eq!(sample(&logits, &ignore, &[1], 0).token_id, 2);
        // A sampled request never draws a masked token either.
        let r = SamplingParams { min_tokens: 1, stop_token_ids: vec![3], ..random() };
        assert!((0..300).all(|s| ![2, 3].contains(&sample(&logits, &r, &[], s).token_id)));
        // The penalty must not revive a masked token.
        let rp = SamplingParams { repetition_penalty: 1.5, ..p };
        assert_eq!(sample_batch(&logits, 4, &[input(&rp, &[2, 3], &[], 0)], RAW)[0].token_id, 1);
    }

    #[test]
    fn exp_matches_std_and_kth_largest_matches_a_sort() {
        for i in 0..=200_000 {
            let x = -90.0 * i as f32 / 200_000.0;
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            assert!(x < -87.0 || (got - want).abs() <= 3e-7 * want, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        let row: Vec<f32> = (0..1000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 20) as f32).collect();
        let mut sorted = row.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let mut heap = BinaryHeap::new();
        for k in [1, 2, 50, 999] {
            assert_eq!(kth_largest(&row, k, &mut heap), sorted[k - 1]);
        }
        assert_eq!(kth_largest(&[1.0, f32::NEG_INFINITY, 2.0], 2, &mut heap), 1.0);
        assert_eq!(kth_largest(&[1.0, f32::NEG_INFINITY, 2.0], 3, &mut heap), f32::NEG_INFINITY);
    }

    #[test]
    fn logprobs_are_raw_log_softmax_sorted() {
        let logits: Vec<f32> = (0..30).map(|i| ((i * 7) % 11) as f32 * 0.5 - 1.0).collect();
        let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        let raw = |id: u32| logits[id as usize] as f64 - lse;
        for n in [0, 1, 5, 20] {
            // Penalties and temperature do not change what is reported.
            let p = SamplingParams { logprobs: Some(n), repetition_penalty: 3.0, temperature: 0.7, ..random() };
            let s = as_draw(sample_batch(&logits, 30, &[input(&p, &[0, 1, 2, 3], &[4], 11)], RAW).remove(0));
            assert!((s.logprob as f64 - raw(s.token_id)).abs() < 1e-6);
            assert_eq!(s.top_logprobs.len(), n as usize);
            for w in s.top_logprobs.windows(2) {
                assert!(w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0), "{w:?}");
            }
            for &(id, lp) in &s.top_logprobs {
                assert!((lp as f64 - raw(id)).abs() < 1e-6);
            }
            // The top-n are the n best: nothing outside beats the last one.
            if let Some(&(_, last)) = s.top_logprobs.last() {
                let inside: Vec<u32> = s.top_logprobs.iter().map(|t| t.0).collect();
                assert!((0..30).filter(|i| !inside.contains(i)).all(|i| raw(i) as f32 <= last));
            }
        }
        assert!(sample(&logits, &random(), &[], 0).logprob.is_nan());
    }
}
