//! The dispatches of one step, in order (the list in the parent module's
//! documentation): what the plan encodes into the step's command buffer.

use super::{
    Access, At, AttentionBuffers, AttentionPlan, Encoder, FeedForward, Gate, LayerWeights, Linear, MATMUL_ROWS,
    MATMUL_SIMDS, MATMUL_TOKENS, Matrix, ROW_THREADS, Readback, Result, StepPlan, bind, words,
};

impl<B: Clone> StepPlan<B> {
    /// The dispatches of one step (checked inputs, written to the GPU);
    /// `attention` holds the step's attention plan for each layer window.
    pub(super) fn encode<E: Encoder<Buffer = B>>(
        &self,
        enc: &mut E,
        t: usize,
        rows: usize,
        attention: &[(Option<usize>, AttentionPlan)],
        readback: Readback,
    ) -> Result<()> {
        let (s, a, k) = (&self.shape, &self.acts, &self.kernels);
        let input = |offset| At { buffer: &self.inputs, offset };
        let u = |x: usize| x as u32; // every size was checked against 32 bits at load

        // Embedding (a later pipeline stage's hidden states were written).
        if let (Some(kernel), Some(embed)) = (&k.embed, &self.weights.embed) {
            enc.set_kernel(kernel);
            enc.set_buffer(0, &embed.buffer, 0, Access::Read);
            bind(enc, 1, input(self.layout.ids), Access::Read);
            enc.set_buffer(2, &a.hidden, 0, Access::Write);
            let mut p = words(&[u(s.hidden), u(s.vocab)]);
            p.extend(s.embed_scale.to_le_bytes());
            enc.set_bytes(3, &p);
            enc.dispatch([t, 1, 1], [ROW_THREADS, 1, 1]);
        }

        let norm_params = |gather: bool, accumulate: bool| {
            let mut p = words(&[u(s.hidden), u32::from(gather), u32::from(accumulate)]);
            p.extend(s.eps.to_le_bytes());
            p
        };
        // out (+)= rms_norm(x) * weight over the step's rows.
        let norm = |enc: &mut E, x: &B, weight: &B, out: &B, accumulate: bool| {
            enc.set_kernel(&k.norm);
            enc.set_buffer(0, x, 0, Access::Read);
            enc.set_buffer(1, weight, 0, Access::Read);
            // Unread without gathering; bound so every parameter has a buffer.
            bind(enc, 2, input(self.layout.rows), Access::Read);
            enc.set_buffer(3, out, 0, Access::Write);
            enc.set_bytes(4, &norm_params(false, accumulate));
            enc.dispatch([t, 1, 1], [ROW_THREADS, 1, 1]);
        };
        // hidden += a sublayer's output: in the matmul's epilogue, or, under
        // Gemma's output norm, stored, normed and added.
        let add_output = |enc: &mut E, linear: &Linear<B>, x: &B, out_norm: Option<&B>| match out_norm {
            None => self.matmul(enc, linear.parts(), x, Output::whole(&a.hidden), t, MatmulMode::Accumulate),
            Some(weight) => {
                self.matmul(enc, linear.parts(), x, Output::whole(&a.normed), t, MatmulMode::Store);
                norm(enc, &a.normed, weight, &a.hidden, true);
            }
        };
        let qkv_rows = (s.heads + 2 * s.kv_heads) * s.head_dim;
        for (layer, (k_cache, v_cache)) in self.weights.layers.iter().zip(&self.kv) {
            norm(enc, &a.hidden, &layer.input_norm, &a.normed, false);
            // q, k and v side by side in each qkv row, from one matmul or several.
            let mut column = 0;
            for part in &layer.qkv {
                let out = Output { y: &a.qkv, stride: Some(qkv_rows), offset: column };
                self.matmul(enc, part.parts(), &a.normed, out, t, MatmulMode::Store);
                column += part.weight.rows;
            }

            enc.set_kernel(&k.rope);
            enc.set_buffer(0, &a.qkv, 0, Access::Read);
            let (cos, sin) =
                layer.rope.as_ref().map_or((&self.weights.rope_cos, &self.weights.rope_sin), |(c, s)| (c, s));
            enc.set_buffer(1, cos, 0, Access::Read);
            enc.set_buffer(2, sin, 0, Access::Read);
            bind(enc, 3, input(self.layout.positions), Access::Read);
            bind(enc, 4, input(self.layout.slots), Access::Read);
            // Unread without head norms; bound to the cos table then.
            let (qn, kn) =
                layer.head_norm.as_ref().map_or((&self.weights.rope_cos, &self.weights.rope_cos), |(q, k)| (q, k));
            enc.set_buffer(5, qn, 0, Access::Read);
            enc.set_buffer(6, kn, 0, Access::Read);
            enc.set_buffer(7, &a.q, 0, Access::Write);
            enc.set_buffer(8, k_cache, 0, Access::Write);
            enc.set_buffer(9, v_cache, 0, Access::Write);
            let num_slots = self.limits.num_blocks * self.limits.block_size;
            let head_norm = u32::from(layer.head_norm.is_some());
            let padded = u(self.padded());
            let mut p =
                words(&[u(s.heads), u(s.kv_heads), u(s.head_dim), padded, u(s.rotary_dim), u(num_slots), head_norm]);
            p.extend(s.eps.to_le_bytes());
            enc.set_bytes(10, &p);
            enc.dispatch([s.heads + 2 * s.kv_heads, t, 1], [32, 1, 1]);

            let plan = &attention.iter().find(|(w, _)| *w == layer.window).expect("a plan per layer window").1;
            plan.encode(
                enc,
                AttentionBuffers {
                    q: At { buffer: &a.q, offset: 0 },
                    k_cache: At { buffer: k_cache, offset: 0 },
                    v_cache: At { buffer: v_cache, offset: 0 },
                    out: At { buffer: &a.attn, offset: 0 },
                    meta: &self.meta,
                    scratch: self.scratch.as_ref(),
                    sinks: layer.sinks.as_ref().map(|buffer| At { buffer, offset: 0 }),
                },
            );
            add_output(enc, &layer.o_proj, &a.attn, layer.attn_out_norm.as_ref());
            norm(enc, &a.hidden, &layer.post_norm, &a.normed, false);
            self.mlp(enc, layer, t, &add_output);
        }
        let (Some(head), Some(weights)) = (&self.head, &self.weights.head) else { return Ok(()) };
        if rows == 0 || matches!(readback, Readback::Hidden) {
            return Ok(());
        }

        // The final norm of the wanted rows only, then lm_head.
        enc.set_kernel(&k.norm);
        enc.set_buffer(0, &a.hidden, 0, Access::Read);
        enc.set_buffer(1, &weights.final_norm, 0, Access::Read);
        bind(enc, 2, input(self.layout.rows), Access::Read);
        enc.set_buffer(3, &head.head_in, 0, Access::Write);
        enc.set_bytes(4, &norm_params(true, false));
        enc.dispatch([rows, 1, 1], [ROW_THREADS, 1, 1]);
        let lm_head = (&weights.lm_head, None);
        self.matmul(enc, lm_head, &head.head_in, Output::whole(&head.logits), rows, MatmulMode::Store);

        if let Readback::Sample(_) = readback {
            head.sampler.encode(enc, &head.logits, rows);
        }
        Ok(())
    }

    /// A layer's MLP over `normed`, added to the residual stream by
    /// `add_output` (through Gemma's output norm where the layer has one).
    fn mlp<E, F>(&self, enc: &mut E, layer: &LayerWeights<B>, t: usize, add_output: &F)
    where
        E: Encoder<Buffer = B>,
        F: Fn(&mut E, &Linear<B>, &B, Option<&B>),
    {
        let a = &self.acts;
        let dense = |enc: &mut E, gate_up: &Linear<B>, down: &Linear<B>, out_norm: Option<&B>| {
            self.matmul(enc, gate_up.parts(), &a.normed, Output::whole(&a.act), t, self.gated());
            add_output(enc, down, &a.act, out_norm);
        };
        match &layer.mlp {
            FeedForward::Dense { gate_up, down } => dense(enc, gate_up, down, layer.mlp_out_norm.as_ref()),
            // The plan refuses experts under an output norm at load.
            FeedForward::Experts(x) => {
                self.experts(enc, x, t);
                if let Some((gate_up, down)) = &x.shared {
                    dense(enc, gate_up, down, None);
                }
            }
        }
    }

    /// The gated matmul mode of the model's activation.
    pub(super) fn gated(&self) -> MatmulMode {
        match self.shape.activation {
            Gate::Silu => MatmulMode::Swiglu,
            Gate::GeluTanh => MatmulMode::Geglu,
            Gate::ClampedSwiglu { .. } => MatmulMode::ClampedSwiglu,
        }
    }

    /// The clamp of gpt-oss's gate (unread by the other modes).
    pub(super) fn limit(&self) -> f32 {
        match self.shape.activation {
            Gate::ClampedSwiglu { limit } => limit,
            _ => 0.0,
        }
    }

    /// `y (+)= x W^T (+ b)` over `t` tokens; the widths come from W
    /// (`[out, in]`, or `[2 out, in]` under a gated mode).
    pub(super) fn matmul<E: Encoder<Buffer = B>>(
        &self,
        enc: &mut E,
        (weight, bias): (&Matrix<B>, Option<&B>),
        x: &B,
        y: Output<'_, B>,
        t: usize,
        mode: MatmulMode,
    ) {
        let inp = weight.cols;
        let out = if mode.is_gated() { weight.rows / 2 } else { weight.rows };
        enc.set_kernel(self.kernels.matmul(weight.format));
        enc.set_buffer(0, x, 0, Access::Read);
        enc.set_buffer(1, &weight.buffer, 0, Access::Read);
        // Unread without a bias; bound to x then (f32, aligned).
        enc.set_buffer(2, bias.unwrap_or(x), 0, Access::Read);
        enc.set_buffer(3, y.y, 0, Access::Write);
        let has_bias = u32::from(bias.is_some());
        // A whole output is `out` wide.
        let (stride, offset) = (y.stride.unwrap_or(out) as u32, y.offset as u32);
        let mut p = words(&[t as u32, inp as u32, out as u32, mode as u32, has_bias, stride, offset]);
        p.extend(self.limit().to_le_bytes());
        enc.set_bytes(4, &p);
        enc.dispatch([out.div_ceil(MATMUL_ROWS), t.div_ceil(MATMUL_TOKENS), 1], [MATMUL_SIMDS * 32, 1, 1]);
    }
}

/// Where a matmul writes: columns `offset..offset + out` of rows of
/// `stride` (None: rows of `out`, the whole of `y`).
pub(super) struct Output<'a, B> {
    y: &'a B,
    stride: Option<usize>,
    offset: usize,
}

impl<'a, B> Output<'a, B> {
    pub(super) fn whole(y: &'a B) -> Self {
        Self { y, stride: None, offset: 0 }
    }
}

/// The matmul's epilogue (`kMode*` in model.metal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MatmulMode {
    Store = 0,
    Accumulate = 1,
    Swiglu = 2,
    Geglu = 3,
    ClampedSwiglu = 4,
}

impl MatmulMode {
    /// Whether W is `[G; U]` and the output their gated product.
    fn is_gated(self) -> bool {
        matches!(self, Self::Swiglu | Self::Geglu | Self::ClampedSwiglu)
    }
}

/// The dispatches of a whole dense model's step of `layers` layers whose
/// attention takes `attention` dispatches per layer, with `rows` wanted
/// rows (a mixture of experts' layer takes 4 more, 6 with a shared expert;
/// each Gemma output norm 1 more).
pub fn dispatches_per_step(layers: usize, attention: usize, rows: usize, readback: Readback) -> usize {
    let head = match readback {
        _ if rows == 0 => 0,
        Readback::Hidden => 0,
        Readback::Logits => 2,
        Readback::Sample(_) => 3,
    };
    1 + layers * (7 + attention) + head
}
