//! Sampling on the model's device, with tensor ops only, so that a GPU step
//! sends back token ids rather than `[S, vocab]` logits.
//!
//! It does what the host sampler's `draw` does for a row without penalties,
//! `min_tokens` or logprobs: temperature, then top-k and min-p as floors
//! below the top token, then top-p, then the token at which the cumulative
//! weight, in vocabulary order, first exceeds `u` times the kept total (`u`
//! is the request's per-position uniform, the same one the host uses). GPUs
//! have no cheap sort, so every threshold is found by bisection over
//! reductions that keep all rows in flight at once:
//! * top-k: the largest scaled logit `t` with `count(s >= t) >= k`;
//! * top-p: the largest `t` whose kept mass `Σ w[s >= t]` reaches `p`;
//! * the draw: the index `j` with `C(j) <= u·total < C(j + 1)`, where
//!   `C(j) = Σ_{i<j} w_i`.
//!
//! Greedy rows take the argmax. The host path remains for rows that need
//! penalties, `min_tokens` or logprobs.

use candle_core::{D, DType, Tensor};

use crate::error::Result;

/// Below this scaled logit a token's weight is 0 in f32 (e^-87).
const MIN_SCALED: f32 = -87.0;
/// Bisection steps on the scaled-logit range [-87, 0]: 2^-30 of it is
/// below f32 resolution near 0.
const VALUE_STEPS: usize = 30;

/// One sampling row's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceRow {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means off.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// The row's uniform draw in [0, 1).
    pub u: f64,
}

/// Token ids for `logits: [S, vocab]` (any float dtype, on any device), one
/// row per entry of `rows`.
pub fn sample(logits: &Tensor, rows: &[DeviceRow]) -> Result<Vec<u32>> {
    let (s, vocab) = logits.dims2()?;
    if s != rows.len() {
        return Err(candle_core::Error::Msg(format!("device sampler: {s} logit rows for {} params", rows.len())).into());
    }
    if s == 0 {
        return Ok(Vec::new());
    }
    let device = logits.device();
    let x = logits.to_dtype(DType::F32)?;
    // NaN logits are impossible tokens, as on the host.
    let x = x.ne(&x)?.where_cond(&Tensor::full(f32::NEG_INFINITY, (s, vocab), device)?, &x)?;
    let greedy = x.argmax(D::Minus1)?.to_dtype(DType::U32)?; // [S]
    if rows.iter().all(|r| r.temperature == 0.0) {
        return Ok(greedy.to_vec1::<u32>()?);
    }
    let column = |f: &dyn Fn(&DeviceRow) -> f32| Tensor::from_vec(rows.iter().map(f).collect(), (s, 1), device);
    // Scaled logits, 0 for the top token: s = (x - max) / T, clamped so that
    // the bisections below work on a bounded range.
    let inv_t = column(&|r| if r.temperature > 0.0 { 1.0 / r.temperature } else { 1.0 })?;
    let max = x.max_keepdim(D::Minus1)?;
    let scaled = x.broadcast_sub(&max)?.broadcast_mul(&inv_t)?.clamp(MIN_SCALED, 0f32)?;
    let mut weights = scaled.exp()?;
    // A weight of exactly e^-87 is a clamped -inf or far tail: out.
    weights = weights.broadcast_mul(&scaled.gt(MIN_SCALED)?.to_dtype(DType::F32)?)?;

    // Min-p: a floor relative to the top token's weight, which is 1.
    if rows.iter().any(|r| r.min_p > 0.0) {
        let floor = column(&|r| r.min_p)?;
        weights = weights.broadcast_mul(&weights.broadcast_ge(&floor)?.to_dtype(DType::F32)?)?;
    }
    // Top-k: keep s >= the k-th largest scaled logit (ties kept).
    if rows.iter().any(|r| r.top_k > 0 && (r.top_k as usize) < vocab) {
        let k = column(&|r| if r.top_k > 0 { r.top_k as f32 } else { vocab as f32 })?;
        let threshold = bisect_value(&scaled, |t| {
            let count = scaled.broadcast_ge(t)?.to_dtype(DType::F32)?.sum_keepdim(D::Minus1)?;
            Ok(count.ge(&k)?)
        })?;
        weights = weights.broadcast_mul(&scaled.broadcast_ge(&threshold)?.to_dtype(DType::F32)?)?;
    }
    // Top-p: the most likely tokens whose weight reaches p of the kept total.
    if rows.iter().any(|r| r.top_p < 1.0) {
        let total = weights.sum_keepdim(D::Minus1)?;
        let target = total.broadcast_mul(&column(&|r| r.top_p.min(1.0))?)?;
        let threshold = bisect_value(&scaled, |t| {
            let mass = weights.broadcast_mul(&scaled.broadcast_ge(t)?.to_dtype(DType::F32)?)?.sum_keepdim(D::Minus1)?;
            Ok(mass.ge(&target)?)
        })?;
        weights = weights.broadcast_mul(&scaled.broadcast_ge(&threshold)?.to_dtype(DType::F32)?)?;
    }
    let drawn = draw(&weights, rows)?; // [S]
    let is_greedy = Tensor::from_vec(rows.iter().map(|r| u8::from(r.temperature == 0.0)).collect(), s, device)?;
    Ok(is_greedy.where_cond(&greedy, &drawn)?.to_vec1::<u32>()?)
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

    fn row(temperature: f32, top_k: u32, top_p: f32, min_p: f32, u: f64) -> DeviceRow {
        DeviceRow { temperature, top_k, top_p, min_p, u }
    }

    /// Host reference: the same algorithm with sorting, in f64.
    fn reference(logits: &[f32], r: &DeviceRow) -> u32 {
        if r.temperature == 0.0 {
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            return logits.iter().position(|&x| x == max).unwrap() as u32;
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let scaled: Vec<f64> = logits.iter().map(|&x| ((x as f64 - max) / r.temperature as f64).max(-87.0)).collect();
        let mut w: Vec<f64> = scaled.iter().map(|s| if *s > -87.0 { s.exp() } else { 0.0 }).collect();
        let mut sorted = scaled.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if r.top_k > 0 && (r.top_k as usize) < w.len() {
            let kth = sorted[r.top_k as usize - 1];
            w.iter_mut().zip(&scaled).for_each(|(w, s)| *w = if *s >= kth { *w } else { 0.0 });
        }
        w.iter_mut().for_each(|w| *w = if *w >= r.min_p as f64 { *w } else { 0.0 });
        if r.top_p < 1.0 {
            let total: f64 = w.iter().sum();
            let mut order: Vec<usize> = (0..w.len()).collect();
            order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]));
            let mut mass = 0.0;
            let mut cut = f64::NEG_INFINITY;
            for &i in &order {
                mass += w[i];
                if mass >= r.top_p as f64 * total {
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
            let got = sample(&t, &rows).unwrap();
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
        let got = sample(&Tensor::from_vec(all, (n, 4), &Device::Cpu).unwrap(), &rows).unwrap();
        let mut counts = [0usize; 4];
        got.iter().for_each(|&t| counts[t as usize] += 1);
        assert_eq!(counts[0], 0);
        for (i, p) in [(1, 2.0 / 9.0), (2, 3.0 / 9.0), (3, 4.0 / 9.0)] {
            let f = counts[i] as f64 / n as f64;
            assert!((f - p).abs() < 0.03, "token {i}: {f} vs {p}");
        }
    }

    #[test]
    fn odd_rows_do_not_panic() {
        // A NaN logit is an impossible token; a row with nothing possible
        // still yields an id in range.
        let logits =
            Tensor::from_vec(vec![f32::NAN, 1.0, f32::NEG_INFINITY, f32::NEG_INFINITY], (2, 2), &Device::Cpu).unwrap();
        let got = sample(&logits, &[row(1.0, 0, 0.5, 0.0, 0.99), row(0.8, 1, 1.0, 0.1, 0.0)]).unwrap();
        assert_eq!(got[0], 1, "only token 1 has weight");
        assert!(got[1] < 2);
        assert!(sample(&logits, &[row(1.0, 0, 1.0, 0.0, 0.5)]).is_err(), "rows and params disagree");
    }
}
