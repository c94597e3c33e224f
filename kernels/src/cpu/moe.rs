//! A mixture-of-experts layer's expert half on the CPU, as llama.cpp's
//! `mul_mat_id` and vLLM's fused MoE run it: the step's (token, expert)
//! pairs are grouped by expert ([`ExpertGroups`]), each token's row is
//! copied once per chosen expert into an expert-major buffer
//! ([`gather_rows`]), every active expert multiplies its own contiguous
//! rows in **one** parallel call over all of them ([`grouped_matmul`]:
//! a GEMV per expert at decode, a GEMM per expert at prefill, each reading
//! only the chosen experts' weights, once), and the weighted sum goes back
//! to each token in one pass ([`combine`]).
//!
//! One call per projection instead of one per expert matters twice: the
//! pool is woken once, not once per active expert (64 at a 16-stream decode
//! step of a 128-expert model), and threads that finish an expert steal the
//! next one instead of waiting at a barrier.
//!
//! The weights stay in their own format: an expert is anything that can
//! multiply ([`ExpertLinear`]), so the matmuls are the dense, packed and
//! quantized kernels the rest of the model runs.
//!
//! Order of the weighted sum: each token adds its experts' outputs in
//! ascending expert order, each product rounded before the add, as
//! transformers' `index_add_` loop over experts does.

use std::ops::Range;

use rayon::prelude::*;

use super::OutPtr;
use crate::{KernelError, Result};

/// The step's routing grouped by expert: the pairs of expert `e` are
/// `offsets[e]..offsets[e + 1]`, in ascending token order; pair `p` takes
/// token `tokens[p]`'s row and adds its output times `weights[p]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertGroups {
    offsets: Vec<usize>,
    tokens: Vec<u32>,
    weights: Vec<f32>,
    /// Per token, its pairs in ascending expert order (`per_token` each).
    pairs_of_token: Vec<u32>,
    per_token: usize,
}

impl ExpertGroups {
    /// Groups `experts`/`weights` (token-major, `per_token` choices per
    /// token) by expert. A token may not choose an expert twice.
    pub fn new(num_experts: usize, per_token: usize, experts: &[u32], weights: &[f32]) -> Result<Self> {
        let invalid = |what: String| Err(KernelError::Invalid(format!("expert groups: {what}")));
        if per_token == 0 || experts.len() != weights.len() || !experts.len().is_multiple_of(per_token) {
            return invalid(format!("{} choices, {} weights, {per_token} per token", experts.len(), weights.len()));
        }
        if let Some(&e) = experts.iter().find(|&&e| e as usize >= num_experts) {
            return invalid(format!("expert {e} of {num_experts}"));
        }
        for (t, chosen) in experts.chunks_exact(per_token).enumerate() {
            if chosen.iter().enumerate().any(|(i, e)| chosen[..i].contains(e)) {
                return invalid(format!("token {t} chose an expert twice: {chosen:?}"));
            }
        }
        let mut offsets = vec![0usize; num_experts + 1];
        for &e in experts {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..num_experts {
            offsets[e + 1] += offsets[e];
        }
        let pairs = experts.len();
        let mut next = offsets.clone();
        let (mut tokens, mut group_weights) = (vec![0u32; pairs], vec![0f32; pairs]);
        let mut pair_of_choice = vec![0u32; pairs];
        // Tokens ascend within each expert: choices are visited token-major.
        for (c, (&e, &w)) in experts.iter().zip(weights).enumerate() {
            let p = next[e as usize];
            next[e as usize] += 1;
            tokens[p] = (c / per_token) as u32;
            group_weights[p] = w;
            pair_of_choice[c] = p as u32;
        }
        // A token's pairs in ascending expert order: pairs are numbered
        // expert-major, so sorting its pair numbers sorts its experts.
        let mut pairs_of_token = pair_of_choice;
        pairs_of_token.chunks_exact_mut(per_token).for_each(|c| c.sort_unstable());
        Ok(Self { offsets, tokens, weights: group_weights, pairs_of_token, per_token })
    }

    pub fn num_experts(&self) -> usize {
        self.offsets.len() - 1
    }

    pub fn num_tokens(&self) -> usize {
        self.pairs_of_token.len() / self.per_token
    }

    /// (token, expert) pairs: rows of the grouped buffers.
    pub fn num_pairs(&self) -> usize {
        self.tokens.len()
    }

    /// Expert `e`'s rows of the grouped buffers.
    pub fn rows_of(&self, e: usize) -> Range<usize> {
        self.offsets[e]..self.offsets[e + 1]
    }

    /// The experts some token chose, with their rows, ascending.
    pub fn active(&self) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        (0..self.num_experts()).map(|e| (e, self.rows_of(e))).filter(|(_, r)| !r.is_empty())
    }

    /// The token of each grouped row.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The routing weight of each grouped row.
    pub fn weights(&self) -> &[f32] {
        &self.weights
    }
}

/// One expert's linear map `y = x W^T (+ b)`, `x: [m, in]`, `y: [m, out]`,
/// in whatever format its weight is kept.
pub trait ExpertLinear: Sync {
    /// `(out, in)`.
    fn dims(&self) -> (usize, usize);
    fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()>;
}

impl<T: ExpertLinear + ?Sized> ExpertLinear for &T {
    fn dims(&self) -> (usize, usize) {
        (**self).dims()
    }
    fn matmul(&self, x: &[f32], m: usize, y: &mut [f32]) -> Result<()> {
        (**self).matmul(x, m, y)
    }
}

/// `xg[p] = x[tokens[p]]`: each token's row once per chosen expert,
/// expert-major. `x: [tokens, hidden]`, `xg: [pairs, hidden]`.
pub fn gather_rows(x: &[f32], hidden: usize, groups: &ExpertGroups, xg: &mut [f32]) -> Result<()> {
    if x.len() != groups.num_tokens() * hidden || xg.len() != groups.num_pairs() * hidden {
        return Err(KernelError::Invalid(format!(
            "gather_rows: x {}, xg {} for {} tokens, {} pairs of {hidden}",
            x.len(),
            xg.len(),
            groups.num_tokens(),
            groups.num_pairs()
        )));
    }
    if hidden == 0 {
        return Ok(());
    }
    for (row, &t) in xg.chunks_exact_mut(hidden).zip(&groups.tokens) {
        row.copy_from_slice(&x[t as usize * hidden..][..hidden]);
    }
    Ok(())
}

/// `yg[rows of e] = xg[rows of e] @ W_e^T` for every active expert `e`, in
/// one parallel call (`xg: [pairs, in]`, `yg: [pairs, out]`). Experts are
/// tasks of rayon's pool, and each expert's own kernel splits its rows
/// among the threads that are free, so one expert (batch-1 decode with
/// few experts) and many (prefill) both keep every core busy.
pub fn grouped_matmul<L: ExpertLinear>(experts: &[L], groups: &ExpertGroups, xg: &[f32], yg: &mut [f32]) -> Result<()> {
    if experts.len() != groups.num_experts() {
        return Err(KernelError::Invalid(format!(
            "grouped_matmul: {} experts, routing over {}",
            experts.len(),
            groups.num_experts()
        )));
    }
    let Some(first) = experts.first() else { return Ok(()) };
    let (out, inp) = first.dims();
    if let Some(e) = experts.iter().position(|e| e.dims() != (out, inp)) {
        return Err(KernelError::Invalid(format!(
            "grouped_matmul: expert {e} is {:?}, expert 0 {:?}",
            experts[e].dims(),
            (out, inp)
        )));
    }
    let pairs = groups.num_pairs();
    if xg.len() != pairs * inp || yg.len() != pairs * out {
        return Err(KernelError::Invalid(format!(
            "grouped_matmul: xg {}, yg {} for {pairs} pairs, experts [{out}, {inp}]",
            xg.len(),
            yg.len()
        )));
    }
    let active: Vec<(usize, Range<usize>)> = groups.active().collect();
    let y = OutPtr(yg.as_mut_ptr());
    let run = |(e, rows): &(usize, Range<usize>)| -> Result<()> {
        // SAFETY: experts' row ranges are disjoint and lie in yg (checked
        // above: offsets end at `pairs`); yg outlives the loop.
        let y = unsafe { std::slice::from_raw_parts_mut(y.get().add(rows.start * out), rows.len() * out) };
        experts[*e].matmul(&xg[rows.start * inp..rows.end * inp], rows.len(), y)
    };
    match active.len() {
        0 => Ok(()),
        1 => run(&active[0]),
        _ => active.par_iter().try_for_each(run),
    }
}

/// `out[t] = sum over t's experts e, ascending, of w(t, e) * yg[(t, e)]`:
/// the weighted sum back in token order, every element of `out
/// [tokens, hidden]` written.
pub fn combine(yg: &[f32], hidden: usize, groups: &ExpertGroups, out: &mut [f32]) -> Result<()> {
    if yg.len() != groups.num_pairs() * hidden || out.len() != groups.num_tokens() * hidden {
        return Err(KernelError::Invalid(format!(
            "combine: yg {}, out {} for {} pairs, {} tokens of {hidden}",
            yg.len(),
            out.len(),
            groups.num_pairs(),
            groups.num_tokens()
        )));
    }
    if hidden == 0 {
        return Ok(());
    }
    let token = |(o, pairs): (&mut [f32], &[u32])| {
        o.fill(0.0);
        for &p in pairs {
            let (w, y) = (groups.weights[p as usize], &yg[p as usize * hidden..][..hidden]);
            // Product rounded, then added, as transformers does.
            o.iter_mut().zip(y).for_each(|(o, &y)| *o += w * y);
        }
    };
    let per = groups.per_token;
    if out.len() < 1 << 15 {
        out.chunks_exact_mut(hidden).zip(groups.pairs_of_token.chunks_exact(per)).for_each(token);
    } else {
        out.par_chunks_exact_mut(hidden).zip(groups.pairs_of_token.par_chunks_exact(per)).for_each(token);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token 0 chose 3 then 1, token 1 chose 1 then 0, token 2 chose 3
    /// then 0: expert-major rows, tokens ascending inside each expert,
    /// each token's pairs in ascending expert order.
    #[test]
    fn groups_are_expert_major_with_tokens_ascending() {
        let g = ExpertGroups::new(4, 2, &[3, 1, 1, 0, 3, 0], &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]).unwrap();
        assert_eq!((g.num_tokens(), g.num_pairs(), g.num_experts()), (3, 6, 4));
        assert_eq!(g.active().collect::<Vec<_>>(), [(0, 0..2), (1, 2..4), (3, 4..6)]);
        assert_eq!(g.tokens(), [1, 2, 0, 1, 0, 2]);
        assert_eq!(g.weights(), [0.4, 0.6, 0.2, 0.3, 0.1, 0.5]);
        assert_eq!(g.pairs_of_token, [2, 4, 0, 3, 1, 5]);
    }

    #[test]
    fn bad_routings_are_refused() {
        assert!(ExpertGroups::new(4, 2, &[0, 4], &[1.0, 1.0]).is_err(), "expert out of range");
        assert!(ExpertGroups::new(4, 2, &[1, 1], &[1.0, 1.0]).is_err(), "the same expert twice");
        assert!(ExpertGroups::new(4, 2, &[1, 2, 3], &[1.0; 3]).is_err(), "not whole tokens");
        assert!(ExpertGroups::new(4, 2, &[1, 2], &[1.0]).is_err(), "a weight short");
        assert!(ExpertGroups::new(4, 0, &[], &[]).is_err(), "no expert per token");
        let empty = ExpertGroups::new(4, 2, &[], &[]).unwrap();
        assert_eq!((empty.num_tokens(), empty.active().count()), (0, 0));
    }
}
