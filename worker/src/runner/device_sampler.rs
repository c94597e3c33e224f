//! Sampling on the model's device, with tensor ops only, so that a GPU step
//! sends back token ids (and the logprobs a request asked for) rather than
//! `[S, vocab]` logits.
//!
//! It does what the host sampler does, in vLLM's order: the
//! structured-output mask, `min_tokens` masking, logit bias, repetition, frequency and presence penalties, then
//! either the argmax or temperature, top-k and min-p as floors below the
//! top token, top-p, and the token at which the cumulative weight, in
//! vocabulary order, first exceeds `u` times the kept total (`u` is the request's
//! per-position uniform, the same one the host uses). GPUs have no cheap
//! sort, so every threshold is found by bisection over reductions that keep
//! all rows in flight at once:
//! * top-k: the largest scaled logit `t` with `count(s >= t) >= k`;
//! * top-p: the largest `t` whose kept mass `Σ w[s >= t]` reaches `p`;
//! * the draw: the index `j` with `C(j) <= u·total < C(j + 1)`, where
//!   `C(j) = Σ_{i<j} w_i`.
//!
//! Penalties count tokens with one scatter-add per step over the rows'
//! histories; top logprobs are N rounds of argmax-and-mask over the raw row.

use candle_core::{D, DType, Device, Tensor};

use common::{SampledToken, SamplingParams, TokenLogprobs};

use crate::error::Result;
use crate::runner::logprobs::LogprobsMode;
use crate::runner::sampler::SamplingRow;

/// Below this scaled logit a token's weight is 0 in f32 (e^-87).
const MIN_SCALED: f32 = -87.0;
/// Bisection steps on the scaled-logit range [-87, 0]: 2^-30 of it is
/// below f32 resolution near 0.
const VALUE_STEPS: usize = 30;

/// A sampling row as the columns read it: the row itself, and what its
/// draw derives from it once (its uniform, and the ids banned now).
struct DeviceRow<'r, 'a> {
    row: &'r SamplingRow<'a>,
    /// The row's uniform draw in [0, 1).
    u: f64,
    /// Ids that must not be drawn now (stop ids and EOS before `min_tokens`).
    banned_token_ids: Vec<u32>,
}

impl<'r, 'a> DeviceRow<'r, 'a> {
    /// As the host does: `min_tokens` bans, except that the grammar beats
    /// them (bans that would leave no token at all are dropped, so EOS is
    /// drawn when it is all the grammar allows).
    fn new(row: &'r SamplingRow<'a>) -> Self {
        let mut banned_token_ids: Vec<u32> = row.banned_now().collect();
        if let Some(allowed) = row.allowed {
            let is_allowed = |t: usize| allowed.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0);
            let allowed_count: usize = allowed.iter().map(|w| w.count_ones() as usize).sum();
            let mut banned = banned_token_ids.clone();
            banned.sort_unstable();
            banned.dedup();
            if banned.iter().filter(|&&t| is_allowed(t as usize)).count() == allowed_count {
                banned_token_ids.clear();
            }
        }
        Self { row, u: row.uniform(), banned_token_ids }
    }

    fn params(&self) -> &SamplingParams {
        self.row.params
    }

    /// 0 for greedy rows.
    fn temperature(&self) -> f32 {
        if self.params().is_greedy() { 0.0 } else { self.params().temperature }
    }
}

/// One token per row of `logits: [S, vocab]` (any float dtype, on any
/// device), with logprobs (as `mode` reports them) where the row asks for
/// them, as on the host.
pub fn sample(logits: &Tensor, rows: &[SamplingRow], mode: LogprobsMode) -> Result<Vec<SampledToken>> {
    let rows: Vec<DeviceRow> = rows.iter().map(DeviceRow::new).collect();
    sample_rows(logits, &rows, mode)
}

fn sample_rows(logits: &Tensor, rows: &[DeviceRow], mode: LogprobsMode) -> Result<Vec<SampledToken>> {
    let (s, vocab) = logits.dims2()?;
    if s != rows.len() {
        return Err(candle_core::Error::Msg(format!("device sampler: {s} logit rows for {} params", rows.len())).into());
    }
    if s == 0 {
        return Ok(Vec::new());
    }
    let device = logits.device();
    let raw = logits.to_dtype(DType::F32)?;
    // NaN logits are impossible tokens, as on the host.
    let raw = raw.ne(&raw)?.where_cond(&Tensor::full(f32::NEG_INFINITY, (s, vocab), device)?, &raw)?;
    let x = adjust(&raw, rows)?;
    let ids = choose(&x, rows)?; // [S] u32
    let logprobs = top_logprobs(&raw, &ids, rows, mode)?;
    let ids = ids.to_vec1::<u32>()?;
    Ok(ids
        .into_iter()
        .zip(logprobs)
        .map(|(token_id, lp)| SampledToken {
            token_id,
            logprobs: lp.map(|(logprob, top)| TokenLogprobs { logprob, top }),
        })
        .collect())
}

/// A `[S, 1]` column of one f32 per row.
fn column(rows: &[DeviceRow], device: &Device, f: impl Fn(&DeviceRow) -> f32) -> Result<Tensor> {
    Ok(Tensor::from_vec(rows.iter().map(f).collect(), (rows.len(), 1), device)?)
}

/// `min_tokens` bans and the penalties, as the host's `apply_min_tokens`
/// and `apply_penalties` do them (same f32 operations, so greedy rows pick
/// what the host picks).
fn adjust(x: &Tensor, rows: &[DeviceRow]) -> Result<Tensor> {
    let (s, vocab) = x.dims2()?;
    let device = x.device();
    let mut x = x.clone();
    if rows.iter().any(|r| r.row.allowed.is_some()) {
        // One byte per logit crosses to the device: 1 where the grammar
        // (or no grammar) allows the token.
        let mut keep = vec![1u8; s * vocab];
        for (row, allowed) in keep.chunks_exact_mut(vocab).zip(rows).filter_map(|(k, r)| Some((k, r.row.allowed?))) {
            for (t, k) in row.iter_mut().enumerate() {
                *k = u8::from(allowed.get(t / 32).is_some_and(|w| w & (1 << (t % 32)) != 0));
            }
        }
        let keep = Tensor::from_vec(keep, (s, vocab), device)?;
        x = keep.where_cond(&x, &Tensor::full(f32::NEG_INFINITY, (s, vocab), device)?)?;
    }
    if rows.iter().any(|r| !r.params().logit_bias.is_empty()) {
        x = (x + scattered(rows.iter().map(|r| r.params().logit_bias.iter().copied()), s, vocab, device)?)?;
    }
    if rows.iter().any(|r| r.params().repetition_penalty != 1.0) {
        let history = |r: &DeviceRow| -> Vec<u32> {
            if r.params().repetition_penalty == 1.0 {
                return Vec::new();
            }
            r.row.prompt_token_ids.iter().chain(r.row.output_token_ids).copied().collect()
        };
        let seen = token_counts(rows.iter().map(history), s, vocab, device)?.gt(0f32)?;
        let penalty = column(rows, device, |r| r.params().repetition_penalty)?;
        let penalised = x.gt(0f32)?.where_cond(&x.broadcast_div(&penalty)?, &x.broadcast_mul(&penalty)?)?;
        x = seen.where_cond(&penalised, &x)?;
    }
    if rows.iter().any(|r| r.params().frequency_penalty != 0.0 || r.params().presence_penalty != 0.0) {
        let outputs = rows.iter().map(|r| {
            if r.params().frequency_penalty == 0.0 && r.params().presence_penalty == 0.0 {
                Vec::new()
            } else {
                r.row.output_token_ids.to_vec()
            }
        });
        let counts = token_counts(outputs, s, vocab, device)?;
        x = (x - counts.broadcast_mul(&column(rows, device, |r| r.params().frequency_penalty)?)?)?;
        let present = counts.gt(0f32)?.to_dtype(DType::F32)?;
        x = (x - present.broadcast_mul(&column(rows, device, |r| r.params().presence_penalty)?)?)?;
    }
    if rows.iter().any(|r| !r.banned_token_ids.is_empty()) {
        let banned = token_counts(rows.iter().map(|r| r.banned_token_ids.clone()), s, vocab, device)?.gt(0f32)?;
        x = banned.where_cond(&Tensor::full(f32::NEG_INFINITY, (s, vocab), device)?, &x)?;
    }
    Ok(x)
}

/// `[S, vocab]` f32: how often each token occurs in each row's list.
fn token_counts(lists: impl Iterator<Item = Vec<u32>>, s: usize, vocab: usize, device: &Device) -> Result<Tensor> {
    scattered(lists.map(|l| l.into_iter().map(|t| (t, 1.0))), s, vocab, device)
}

/// `[S, vocab]` f32: each row's (id, value) pairs summed into zeros. Ids
/// outside the vocabulary (they come from requests) are ignored.
fn scattered(
    lists: impl Iterator<Item = impl IntoIterator<Item = (u32, f32)>>,
    s: usize,
    vocab: usize,
    device: &Device,
) -> Result<Tensor> {
    let lists: Vec<Vec<(u32, f32)>> =
        lists.map(|l| l.into_iter().filter(|&(t, _)| (t as usize) < vocab).collect()).collect();
    let width = lists.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut index = vec![0u32; s * width];
    let mut values = vec![0f32; s * width];
    for (row, list) in lists.iter().enumerate() {
        for (k, &(t, v)) in list.iter().enumerate() {
            index[row * width + k] = t;
            values[row * width + k] = v;
        }
    }
    let index = Tensor::from_vec(index, (s, width), device)?;
    let values = Tensor::from_vec(values, (s, width), device)?;
    Ok(Tensor::zeros((s, vocab), DType::F32, device)?.scatter_add(&index, &values, 1)?)
}

/// The token of each row of the adjusted logits `x`: the argmax for greedy
/// rows, a draw otherwise. `[S]` u32, still on the device.
fn choose(x: &Tensor, rows: &[DeviceRow]) -> Result<Tensor> {
    let (s, vocab) = x.dims2()?;
    let device = x.device();
    let greedy = x.argmax(D::Minus1)?.to_dtype(DType::U32)?; // [S]
    if rows.iter().all(|r| r.temperature() == 0.0) {
        return Ok(greedy);
    }
    // Scaled logits, 0 for the top token: s = (x - max) / T, clamped so that
    // the bisections below work on a bounded range.
    let inv_t = column(rows, device, |r| if r.temperature() > 0.0 { 1.0 / r.temperature() } else { 1.0 })?;
    let max = x.max_keepdim(D::Minus1)?;
    let scaled = x.broadcast_sub(&max)?.broadcast_mul(&inv_t)?.clamp(MIN_SCALED, 0f32)?;
    let mut weights = scaled.exp()?;
    // A weight of exactly e^-87 is a clamped -inf or far tail: out.
    weights = weights.broadcast_mul(&scaled.gt(MIN_SCALED)?.to_dtype(DType::F32)?)?;

    // Min-p: a floor relative to the top token's weight, which is 1.
    if rows.iter().any(|r| r.params().min_p > 0.0) {
        let floor = column(rows, device, |r| r.params().min_p)?;
        weights = weights.broadcast_mul(&weights.broadcast_ge(&floor)?.to_dtype(DType::F32)?)?;
    }
    // Top-k: keep s >= the k-th largest scaled logit (ties kept).
    if rows.iter().any(|r| r.params().top_k > 0 && (r.params().top_k as usize) < vocab) {
        let k = column(rows, device, |r| if r.params().top_k > 0 { r.params().top_k as f32 } else { vocab as f32 })?;
        let threshold = bisect_value(&scaled, |t| {
            let count = scaled.broadcast_ge(t)?.to_dtype(DType::F32)?.sum_keepdim(D::Minus1)?;
            Ok(count.ge(&k)?)
        })?;
        weights = weights.broadcast_mul(&scaled.broadcast_ge(&threshold)?.to_dtype(DType::F32)?)?;
    }
    // Top-p: the most likely tokens whose weight reaches p of the kept total.
    if rows.iter().any(|r| r.params().top_p < 1.0) {
        let total = weights.sum_keepdim(D::Minus1)?;
        let target = total.broadcast_mul(&column(rows, device, |r| r.params().top_p.min(1.0))?)?;
        let threshold = bisect_value(&scaled, |t| {
            let mass = weights.broadcast_mul(&scaled.broadcast_ge(t)?.to_dtype(DType::F32)?)?.sum_keepdim(D::Minus1)?;
            Ok(mass.ge(&target)?)
        })?;
        weights = weights.broadcast_mul(&scaled.broadcast_ge(&threshold)?.to_dtype(DType::F32)?)?;
    }
    let drawn = draw(&weights, rows)?; // [S]
    let is_greedy = Tensor::from_vec(rows.iter().map(|r| u8::from(r.temperature() == 0.0)).collect(), s, device)?;
    Ok(is_greedy.where_cond(&greedy, &drawn)?)
}

/// The chosen token's logprob and the top `n`, for the rows that ask, from
/// the raw (NaN-cleaned) logits: the top tokens are found by `n` rounds of
/// argmax, each masking its winner, so only `[rows, 1 + n]` values and ids
/// come back. Ties go to the lower id, as on the host.
#[allow(clippy::type_complexity)]
fn top_logprobs(
    raw: &Tensor,
    ids: &Tensor,
    rows: &[DeviceRow],
    mode: LogprobsMode,
) -> Result<Vec<Option<(f32, Vec<(u32, f32)>)>>> {
    let mut out = vec![None; rows.len()];
    let asking: Vec<u32> = (0..rows.len() as u32).filter(|&i| rows[i as usize].params().logprobs.is_some()).collect();
    if asking.is_empty() {
        return Ok(out);
    }
    let device = raw.device();
    let n = asking.iter().map(|&i| rows[i as usize].params().logprobs.unwrap_or(0) as usize).max().unwrap_or(0);
    let pick = Tensor::from_vec(asking.clone(), asking.len(), device)?;
    let x = raw.index_select(&pick, 0)?; // [A, vocab]
    let chosen = ids.index_select(&pick, 0)?.unsqueeze(1)?; // [A, 1]
    let mut id_columns = vec![chosen.clone()];
    let mut value_columns = vec![x.gather(&chosen, 1)?];
    let mut rest = x.clone();
    let masked = Tensor::full(f32::NEG_INFINITY, (asking.len(), 1), device)?;
    for _ in 0..n {
        let top = rest.argmax_keepdim(D::Minus1)?.to_dtype(DType::U32)?; // [A, 1]
        value_columns.push(x.gather(&top, 1)?);
        rest = rest.scatter(&top, &masked, 1)?;
        id_columns.push(top);
    }
    let mut values_t = Tensor::cat(&value_columns, 1)?;
    if mode == LogprobsMode::RawLogprobs {
        let max = x.max_keepdim(D::Minus1)?;
        let lse = (x.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?.log()? + &max)?;
        values_t = values_t.broadcast_sub(&lse)?;
    }
    let values_v = values_t.to_vec2::<f32>()?;
    let ids_v = Tensor::cat(&id_columns, 1)?.to_vec2::<u32>()?;
    for (a, &row) in asking.iter().enumerate() {
        // A row with no finite logit has no distribution: all -inf, as on the host.
        let value = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
        let wanted = rows[row as usize].params().logprobs.unwrap_or(0) as usize;
        let top = (1..=wanted).map(|j| (ids_v[a][j], value(values_v[a][j]))).collect();
        out[row as usize] = Some((value(values_v[a][0]), top));
    }
    Ok(out)
}

/// The largest `t` in [-87, 0] (per row, `[S, 1]`) for which `holds(t)` is
/// true, given that it holds at -87 and, once false, stays false above.
fn bisect_value(scaled: &Tensor, holds: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let s = scaled.dim(0)?;
    let device = scaled.device();
    let mut lo = Tensor::full(MIN_SCALED, (s, 1), device)?;
    let mut hi = Tensor::zeros((s, 1), DType::F32, device)?;
    // Rows where even t = 0 holds (e.g. k >= count of top ties) keep only those.
    let top_holds = holds(&hi)?;
    for _ in 0..VALUE_STEPS {
        let mid = ((&lo + &hi)? * 0.5)?;
        let ok = holds(&mid)?;
        lo = ok.where_cond(&mid, &lo)?;
        hi = ok.where_cond(&hi, &mid)?;
    }
    Ok(top_holds.where_cond(&hi, &lo)?)
}

/// The index `j` with `C(j) <= u·total < C(j + 1)`, `C(j)` the weight
/// before `j` in vocabulary order (so `j` has weight > 0).
fn draw(weights: &Tensor, rows: &[DeviceRow]) -> Result<Tensor> {
    let (s, vocab) = weights.dims2()?;
    let device = weights.device();
    let total = weights.sum_keepdim(D::Minus1)?;
    let u = Tensor::from_vec(rows.iter().map(|r| r.u.clamp(0.0, 1.0 - 1e-7) as f32).collect(), (s, 1), device)?;
    let target = total.broadcast_mul(&u)?;
    let index = Tensor::arange(0u32, vocab as u32, device)?.to_dtype(DType::F32)?.reshape((1, vocab))?;
    let mut lo = Tensor::zeros((s, 1), DType::F32, device)?;
    let mut hi = Tensor::full(vocab as f32, (s, 1), device)?;
    let steps = usize::BITS - (vocab.max(1) - 1).leading_zeros();
    for _ in 0..steps {
        let mid = ((&lo + &hi)? * 0.5)?.floor()?;
        let before = weights.broadcast_mul(&index.broadcast_lt(&mid)?.to_dtype(DType::F32)?)?.sum_keepdim(D::Minus1)?;
        let ok = before.le(&target)?;
        lo = ok.where_cond(&mid, &lo)?;
        hi = ok.where_cond(&hi, &mid)?;
    }
    Ok(lo.squeeze(1)?.to_dtype(DType::U32)?)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    /// A row of a request with these draw parameters (no penalties, bans
    /// or logprobs), drawing with the uniform `u` (leaked: test rows live
    /// as long as the test).
    fn row(temperature: f32, top_k: u32, top_p: f32, min_p: f32, u: f64) -> DeviceRow<'static, 'static> {
        masked_row(temperature, top_k, top_p, min_p, u, None)
    }

    fn masked_row(
        temperature: f32,
        top_k: u32,
        top_p: f32,
        min_p: f32,
        u: f64,
        allowed: Option<&'static [u32]>,
    ) -> DeviceRow<'static, 'static> {
        let params =
            Box::leak(Box::new(SamplingParams { temperature, top_k, top_p, min_p, ..SamplingParams::default() }));
        let row = Box::leak(Box::new(SamplingRow {
            params,
            prompt_token_ids: &[],
            output_token_ids: &[],
            num_output_tokens: 0,
            seed: 0,
            eos_token_ids: &[],
            allowed,
        }));
        DeviceRow { u, ..DeviceRow::new(row) }
    }

    /// Token ids only.
    fn ids(logits: &Tensor, rows: &[DeviceRow]) -> Result<Vec<u32>> {
        Ok(sample_rows(logits, rows, LogprobsMode::RawLogprobs)?.into_iter().map(|s| s.token_id).collect())
    }

    /// Host reference: the same algorithm with sorting, in f64.
    fn reference(logits: &[f32], r: &DeviceRow<'_, '_>) -> u32 {
        if r.temperature() == 0.0 {
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            return logits.iter().position(|&x| x == max).unwrap() as u32;
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let scaled: Vec<f64> = logits.iter().map(|&x| ((x as f64 - max) / r.temperature() as f64).max(-87.0)).collect();
        let mut w: Vec<f64> = scaled.iter().map(|s| if *s > -87.0 { s.exp() } else { 0.0 }).collect();
        let mut sorted = scaled.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if r.params().top_k > 0 && (r.params().top_k as usize) < w.len() {
            let kth = sorted[r.params().top_k as usize - 1];
            w.iter_mut().zip(&scaled).for_each(|(w, s)| *w = if *s >= kth { *w } else { 0.0 });
        }
        w.iter_mut().for_each(|w| *w = if *w >= r.params().min_p as f64 { *w } else { 0.0 });
        if r.params().top_p < 1.0 {
            let total: f64 = w.iter().sum();
            let mut order: Vec<usize> = (0..w.len()).collect();
            order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]));
            let mut mass = 0.0;
            let mut cut = f64::NEG_INFINITY;
            for &i in &order {
                mass += w[i];
                if mass >= r.params().top_p as f64 * total {
                    cut = scaled[i];
                    break;
                }
            }
            w.iter_mut().zip(&scaled).for_each(|(w, s)| *w = if *s >= cut { *w } else { 0.0 });
        }
        let target = r.u * w.iter().sum::<f64>();
        let mut c = 0.0;
        for (i, &wi) in w.iter().enumerate() {
            if c + wi > target && wi > 0.0 {
                return i as u32;
            }
            c += wi;
        }
        w.iter().rposition(|&wi| wi > 0.0).unwrap() as u32
    }

    fn lcg(state: &mut u64) -> f64 {
        *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*state >> 11) as f64 / (1u64 << 53) as f64
    }

    #[test]
    fn matches_the_sorting_reference() {
        let mut st = 7u64;
        let vocab = 300;
        let mut agree = 0;
        let mut total = 0;
        for case in 0..40 {
            let rows: Vec<DeviceRow> = (0..8)
                .map(|i| {
                    let top_k = [0, 1, 5, 50][(i + case) % 4];
                    let top_p = [1.0, 0.9, 0.5, 0.1][(i / 2 + case) % 4];
                    let min_p = [0.0, 0.05][(i + case / 3) % 2];
                    let t = [0.0, 0.7, 1.0, 1.5][(i + case / 2) % 4];
                    row(t, top_k, top_p, min_p, lcg(&mut st))
                })
                .collect();
            let logits: Vec<f32> = (0..rows.len() * vocab).map(|_| (lcg(&mut st) * 8.0 - 4.0) as f32).collect();
            let t = Tensor::from_vec(logits.clone(), (rows.len(), vocab), &Device::Cpu).unwrap();
            let got = ids(&t, &rows).unwrap();
            for (i, r) in rows.iter().enumerate() {
                total += 1;
                agree += usize::from(got[i] == reference(&logits[i * vocab..(i + 1) * vocab], r));
                assert!((got[i] as usize) < vocab);
            }
        }
        // f32 sums against f64 ones may move a draw that lands within
        // rounding of a boundary; nothing else may differ.
        assert!(agree * 100 >= total * 99, "{agree} of {total} agree");
    }

    #[test]
    fn frequencies_follow_the_distribution() {
        // Logits ln(1..=4): probabilities 0.1, 0.2, 0.3, 0.4; top_k 3 drops
        // the first, leaving 2/9, 3/9, 4/9.
        let logits: Vec<f32> = (1..=4).map(|v| (v as f32).ln()).collect();
        let n = 3000;
        let mut st = 1u64;
        let rows: Vec<DeviceRow> = (0..n).map(|_| row(1.0, 3, 1.0, 0.0, lcg(&mut st))).collect();
        let all: Vec<f32> = (0..n).flat_map(|_| logits.iter().copied()).collect();
        let got = ids(&Tensor::from_vec(all, (n, 4), &Device::Cpu).unwrap(), &rows).unwrap();
        let mut counts = [0usize; 4];
        got.iter().for_each(|&t| counts[t as usize] += 1);
        assert_eq!(counts[0], 0);
        for (i, p) in [(1, 2.0 / 9.0), (2, 3.0 / 9.0), (3, 4.0 / 9.0)] {
            let f = counts[i] as f64 / n as f64;
            assert!((f - p).abs() < 0.03, "token {i}: {f} vs {p}");
        }
    }

    #[test]
    fn a_grammar_mask_limits_the_draw_as_on_the_host() {
        let device = Device::Cpu;
        let mut values = [0.0f32; 40];
        values[5] = 9.0;
        values[33] = -3.0;
        let logits = Tensor::from_vec(values.repeat(3), (3, 40), &device).unwrap();
        let allowed: &'static [u32] = &[0b10, 0b10]; // tokens 1 and 33
        for u in [0.0, 0.3, 0.7, 0.999] {
            let rows = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 1, 0.9)]
                .map(|(t, k, p)| masked_row(t, k, p, 0.0, u, Some(allowed)));
            for t in ids(&logits, &rows).unwrap() {
                assert!(t == 1 || t == 33, "drew {t} at u = {u}");
            }
        }
        // EOS (2) is all the grammar allows and min_tokens bans it: EOS.
        let params = SamplingParams { min_tokens: 3, ..SamplingParams::default() };
        let eos_only = [1 << 2];
        let sampling = SamplingRow {
            params: &params,
            prompt_token_ids: &[],
            output_token_ids: &[],
            num_output_tokens: 0,
            seed: 0,
            eos_token_ids: &[2],
            allowed: Some(&eos_only),
        };
        let row = DeviceRow::new(&sampling);
        assert!(row.banned_token_ids.is_empty());
        let logits = Tensor::from_vec(vec![5.0f32, 1.0, 0.0, 3.0], (1, 4), &device).unwrap();
        assert_eq!(ids(&logits, &[row]).unwrap(), vec![2]);
    }

    #[test]
    fn odd_rows_do_not_panic() {
        // A NaN logit is an impossible token; a row with nothing possible
        // still yields an id in range.
        let logits =
            Tensor::from_vec(vec![f32::NAN, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY], (2, 2), &Device::Cpu).unwrap();
        let got = ids(&logits, &[row(1.0, 0, 0.5, 0.0, 0.99), row(0.8, 1, 1.0, 0.1, 0.0)]).unwrap();
        assert_eq!(got[0], 1, "only token 1 has weight");
        assert!(got[1] < 2);
        assert!(ids(&logits, &[row(1.0, 0, 1.0, 0.0, 0.5)]).is_err(), "rows and params disagree");
    }

    #[test]
    fn penalties_bans_and_logprobs_match_the_host_sampler() {
        use crate::runner::sampler::{as_draw, sample_batch};
        let vocab = 257;
        let mut st = 3u64;
        let mut tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| (lcg(&mut st) * vocab as f64) as u32).collect() };
        let prompt = tokens(40);
        let mut output = tokens(25);
        output.extend_from_slice(&output.clone()[..10]); // repeats, for frequency
        output.push(9999); // outside the vocabulary: ignored by both
        let eos = [5u32];
        let greedy = SamplingParams::greedy(100);
        let cases = [
            SamplingParams { repetition_penalty: 1.3, ..greedy.clone() },
            SamplingParams { repetition_penalty: 0.7, ..greedy.clone() },
            SamplingParams { frequency_penalty: 0.5, presence_penalty: 0.3, ..greedy.clone() },
            SamplingParams { frequency_penalty: -0.4, presence_penalty: 1.5, ..greedy.clone() },
            SamplingParams { min_tokens: 100, stop_token_ids: vec![0, 1, 2, 3, 4, 6, 7], ..greedy.clone() },
            SamplingParams { min_tokens: 100, ignore_eos: true, ..greedy.clone() },
            SamplingParams { logprobs: Some(5), ..greedy.clone() },
            SamplingParams { logprobs: Some(0), repetition_penalty: 1.2, frequency_penalty: 0.2, ..greedy.clone() },
            SamplingParams { logprobs: Some(20), temperature: 0.8, seed: Some(4), ..greedy.clone() },
            greedy.clone(),
        ];
        for trial in 0..6u64 {
            let mut logits: Vec<f32> = (0..cases.len() * vocab).map(|_| (lcg(&mut st) * 8.0 - 4.0) as f32).collect();
            for (i, row) in logits.chunks_mut(vocab).enumerate() {
                // Make the bans and penalties matter: the raw favourites are
                // EOS, stop ids and tokens already seen; two tie for top.
                let top = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                row[5] = top + 1.0;
                row[[0, 3, 6][i % 3]] = top + 0.5;
                row[output[(i + trial as usize) % 25] as usize] = top + 0.75;
                row[prompt[(i * 3 + trial as usize) % 40] as usize] = top + 0.9;
                row[200] = top + 0.6;
                row[201] = top + 0.6;
            }
            let inputs: Vec<SamplingRow> = cases
                .iter()
                .map(|p| SamplingRow {
                    params: p,
                    prompt_token_ids: &prompt,
                    output_token_ids: &output,
                    num_output_tokens: output.len(),
                    seed: 11,
                    eos_token_ids: &eos,
                    allowed: None,
                })
                .collect();
            let host: Vec<_> =
                sample_batch(&logits, vocab, &inputs, LogprobsMode::RawLogprobs).into_iter().map(as_draw).collect();
            let t = Tensor::from_vec(logits.clone(), (cases.len(), vocab), &Device::Cpu).unwrap();
            let device: Vec<_> =
                sample(&t, &inputs, LogprobsMode::RawLogprobs).unwrap().into_iter().map(as_draw).collect();
            for (i, (h, d)) in host.iter().zip(&device).enumerate() {
                if cases[i].is_greedy() {
                    assert_eq!(h.token_id, d.token_id, "trial {trial} case {i}");
                }
                if cases[i].logprobs.is_none() {
                    assert!(d.logprob.is_nan() && d.top_logprobs.is_empty());
                    continue;
                }
                let chosen_on_host = h.token_id == d.token_id;
                assert!(!chosen_on_host || (h.logprob - d.logprob).abs() < 1e-4, "case {i}: {h:?} vs {d:?}");
                assert_eq!(h.top_logprobs.len(), d.top_logprobs.len());
                for (a, b) in h.top_logprobs.iter().zip(&d.top_logprobs) {
                    assert_eq!(a.0, b.0, "trial {trial} case {i}: top ids, lower id first on a tie");
                    assert!((a.1 - b.1).abs() < 1e-4, "case {i}: {a:?} vs {b:?}");
                }
            }
            // Raw logits instead of logprobs: the values themselves.
            let raw = sample(&t, &inputs, LogprobsMode::RawLogits).unwrap();
            let (id, value) = raw[6].logprobs.as_ref().expect("asked for").top[0];
            assert_eq!(value, logits[6 * vocab + id as usize]);
        }
    }
}
