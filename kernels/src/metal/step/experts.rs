//! A mixture of experts' MLP on the step plan, llama.cpp's `mul_mat_id`
//! scheme (model.metal): the router's matmul, `moe_route` (each token's
//! experts and weights), `moe_group` (the pairs grouped by expert into
//! tiles), `matmul_id` for the chosen experts' gate/up and down over their
//! pairs only, and `moe_combine` (each token's weighted sum into the
//! residual stream); the buffers and kernels they take.

use super::encode::{MatmulMode, Output};
use super::{
    Access, Encoder, Experts, Kernel, Linear, MATMUL_ROWS, MATMUL_SIMDS, MATMUL_TOKENS, ROW_THREADS, StepPlan,
    WeightFormat, by_format, words,
};

/// Most experts a router may score (`kMaxExperts` in model.metal).
pub const MAX_EXPERTS: usize = 512;

/// The buffers of the mixture-of-experts layers, for `max_tokens` tokens
/// at the largest router, top-k and expert width of the plan's layers.
#[derive(Debug)]
pub(super) struct ExpertBuffers<B> {
    /// `[T, experts]` router logits.
    pub(super) logits: B,
    /// `[T, top_k]` each token's experts (u32), best first, and weights.
    pub(super) ids: B,
    pub(super) weights: B,
    /// `[T * top_k]` pair indices grouped by expert (u32).
    pub(super) order: B,
    /// `[max_tiles, 3]` (u32): expert, first index into `order`, pairs.
    pub(super) tiles: B,
    /// `[T * top_k, I]` and `[T * top_k, hidden]`, a row per pair.
    pub(super) act: B,
    pub(super) out: B,
}

/// The kernels of a plan with mixtures of experts.
#[derive(Debug)]
pub(super) struct ExpertKernels {
    pub(super) route: Kernel,
    pub(super) group: Kernel,
    pub(super) combine: Kernel,
    /// A matmul_id per expert weight format.
    pub(super) matmuls: Vec<(WeightFormat, Kernel)>,
}

/// Tiles of at most `MATMUL_TOKENS` pairs that `pairs` (token, expert)
/// pairs over `experts` experts can need: each active expert's last tile
/// may be partial.
pub(super) fn max_tiles(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(MATMUL_TOKENS) + experts.min(pairs)
}

impl<B: Clone> StepPlan<B> {
    /// `hidden += sum over each token's chosen experts of weight * expert(normed)`:
    /// the router's logits, the choice, the pairs grouped by expert, the
    /// chosen experts' gate/up and down over their pairs only, the sum.
    pub(super) fn experts<E: Encoder<Buffer = B>>(&self, enc: &mut E, x: &Experts<B>, t: usize) {
        let (a, r) = (&self.acts, x.routing);
        let (Some(buf), Some(k)) = (&a.experts, &self.kernels.experts) else {
            unreachable!("a plan with experts has their buffers and kernels")
        };
        let u = |x: usize| x as u32; // checked against 32 bits at load
        let pairs = t * r.top_k;
        self.matmul(enc, x.router.parts(), &a.normed, Output::whole(&buf.logits), t, MatmulMode::Store);

        enc.set_kernel(&k.route);
        enc.set_buffer(0, &buf.logits, 0, Access::Read);
        // Unread without a correction; bound to the logits then.
        enc.set_buffer(1, x.correction.as_ref().unwrap_or(&buf.logits), 0, Access::Read);
        enc.set_buffer(2, &buf.ids, 0, Access::Write);
        enc.set_buffer(3, &buf.weights, 0, Access::Write);
        let mut p = words(&[
            u(r.experts),
            u(r.top_k),
            u32::from(r.sigmoid),
            u32::from(x.correction.is_some()),
            u32::from(r.norm_topk),
            u(r.groups),
            u(r.groups_kept),
        ]);
        p.extend(r.scale.to_le_bytes());
        enc.set_bytes(4, &p);
        enc.dispatch([t, 1, 1], [32, 1, 1]);

        let tiles = max_tiles(pairs, r.experts);
        enc.set_kernel(&k.group);
        enc.set_buffer(0, &buf.ids, 0, Access::Read);
        enc.set_buffer(1, &buf.order, 0, Access::Write);
        enc.set_buffer(2, &buf.tiles, 0, Access::Write);
        enc.set_bytes(3, &words(&[u(pairs), u(r.experts), u(tiles)]));
        enc.dispatch([1, 1, 1], [ROW_THREADS, 1, 1]);

        let matmul_id = |enc: &mut E, linear: &Linear<B>, x: &B, y: &B, out: usize, mode: MatmulMode, x_div: usize| {
            enc.set_kernel(by_format(&k.matmuls, linear.weight.format));
            enc.set_buffer(0, x, 0, Access::Read);
            enc.set_buffer(1, &linear.weight.buffer, 0, Access::Read);
            enc.set_buffer(2, linear.bias.as_ref().unwrap_or(x), 0, Access::Read);
            enc.set_buffer(3, y, 0, Access::Write);
            enc.set_buffer(4, &buf.order, 0, Access::Read);
            enc.set_buffer(5, &buf.tiles, 0, Access::Read);
            let has_bias = u32::from(linear.bias.is_some());
            let mut p = words(&[u(linear.weight.cols), u(out), mode as u32, has_bias, u(x_div)]);
            p.extend(self.limit().to_le_bytes());
            enc.set_bytes(6, &p);
            enc.dispatch([out.div_ceil(MATMUL_ROWS), tiles, 1], [MATMUL_SIMDS * 32, 1, 1]);
        };
        let width = r.expert_intermediate;
        matmul_id(enc, &x.gate_up, &a.normed, &buf.act, width, self.gated(), r.top_k);
        matmul_id(enc, &x.down, &buf.act, &buf.out, self.shape.hidden, MatmulMode::Store, 1);

        enc.set_kernel(&k.combine);
        enc.set_buffer(0, &buf.out, 0, Access::Read);
        enc.set_buffer(1, &buf.weights, 0, Access::Read);
        enc.set_buffer(2, &a.hidden, 0, Access::Write);
        enc.set_bytes(3, &words(&[u(self.shape.hidden), u(r.top_k)]));
        enc.dispatch([t, 1, 1], [ROW_THREADS, 1, 1]);
    }
}
