//! The host sampler's rows as a step plan's GPU sampler reads them
//! (`kernels::metal::step::SampleRow`), and its draws as the engine reports
//! them. The GPU applies what the host sampler applies, in its order; here
//! each row's bans, biases and penalties become one edit per token.

use common::{SampledToken, TokenLogprobs};
use kernels::metal::step::{SampleRow, Sampled, TokenEdit};

use super::logprobs::LogprobsMode;
use super::sampler::SamplingRow;

/// What changes `row`'s logits before its draw, besides its mask: one edit
/// per token, in id order.
pub fn edits_of(row: &SamplingRow) -> Vec<TokenEdit> {
    let p = row.params;
    let repeats = p.repetition_penalty != 1.0;
    let counts = p.frequency_penalty != 0.0 || p.presence_penalty != 0.0;
    // (token, what) marks, sorted, then folded into one edit per token.
    const BANNED: u8 = 0;
    const BIASED: u8 = 1;
    const SEEN: u8 = 2;
    const GENERATED: u8 = 3;
    let mut marks: Vec<(u32, u8)> = row.banned_now().map(|t| (t, BANNED)).collect();
    marks.extend(p.logit_bias.iter().map(|&(t, _)| (t, BIASED)));
    if repeats {
        marks.extend(row.prompt_token_ids.iter().map(|&t| (t, SEEN)));
    }
    if repeats || counts {
        for &t in row.output_token_ids {
            if repeats {
                marks.push((t, SEEN));
            }
            if counts {
                marks.push((t, GENERATED));
            }
        }
    }
    marks.sort_unstable();
    let mut edits: Vec<TokenEdit> = Vec::new();
    for (token, what) in marks {
        if edits.last().is_none_or(|e| e.token != token) {
            edits.push(TokenEdit { token, ..TokenEdit::default() });
        }
        let Some(e) = edits.last_mut() else { continue };
        match what {
            BANNED => e.banned = true,
            BIASED => e.bias = Some(p.bias_of(token)),
            SEEN => e.seen = true,
            _ => e.count += 1,
        }
    }
    edits
}

/// Each of `rows` for the GPU sampler, with its edits (`edits[i]` from
/// [`edits_of`] of `rows[i]`).
pub fn sample_rows<'a>(rows: &[SamplingRow<'a>], edits: &'a [Vec<TokenEdit>]) -> Vec<SampleRow<'a>> {
    rows.iter().zip(edits).map(|(r, e)| sample_row(r, e)).collect()
}

fn sample_row<'a>(row: &SamplingRow<'a>, edits: &'a [TokenEdit]) -> SampleRow<'a> {
    let p = row.params;
    let greedy = p.is_greedy();
    SampleRow {
        temperature: if greedy { 0.0 } else { p.temperature },
        top_k: p.top_k,
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        uniform: if greedy { 0.0 } else { row.uniform() },
        top_logprobs: p.logprobs,
        allowed: row.allowed,
        edits,
    }
}

/// A GPU draw as the host sampler reports it (`sample_batch`).
pub fn sampled_token(s: Sampled, mode: LogprobsMode) -> SampledToken {
    let logprobs = s.logprobs.map(|lp| match mode {
        LogprobsMode::RawLogprobs => {
            let lse = lp.log_sum_exp();
            // A row with no finite logit has no distribution: all -inf.
            let logprob = |x: f32| {
                let x = if x.is_nan() { f32::NEG_INFINITY } else { x };
                let v = (x as f64 - lse) as f32;
                if v.is_nan() { f32::NEG_INFINITY } else { v }
            };
            TokenLogprobs { logprob: logprob(lp.chosen), top: lp.top.iter().map(|&(id, x)| (id, logprob(x))).collect() }
        }
        LogprobsMode::RawLogits => TokenLogprobs { logprob: lp.chosen, top: lp.top },
    });
    SampledToken { token_id: s.token, logprobs }
}

#[cfg(test)]
mod tests {
    use common::SamplingParams;

    use super::*;

    #[test]
    fn edits_fold_bans_biases_and_penalties_into_one_per_token() {
        let params = SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.5,
            min_tokens: 4,
            stop_token_ids: vec![9],
            logit_bias: vec![(2, 1.5), (7, -3.0)],
            ..SamplingParams::default()
        };
        let row = SamplingRow {
            params: &params,
            prompt_token_ids: &[5, 2, 5],
            output_token_ids: &[7, 5, 7],
            num_output_tokens: 3,
            seed: 0,
            eos_token_ids: &[1],
            allowed: None,
        };
        let e = |token, banned, bias, seen, count| TokenEdit { token, banned, bias, seen, count };
        assert_eq!(
            edits_of(&row),
            vec![
                e(1, true, None, false, 0),
                e(2, false, Some(1.5), true, 0),
                e(5, false, None, true, 1),
                e(7, false, Some(-3.0), true, 2),
                e(9, true, None, false, 0),
            ]
        );
        // No penalty, no ban, no bias: nothing to edit.
        let plain = SamplingParams::default();
        assert!(edits_of(&SamplingRow { params: &plain, ..row }).is_empty());
    }
}
