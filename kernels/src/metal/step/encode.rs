//! The dispatches of one step, in order (the list in the parent module's
//! documentation): what the plan encodes into the step's command buffer.

use super::*;

impl<B: Clone> StepPlan<B> {
    /// The dispatches of one step (checked inputs, written to the GPU).
    pub(super) fn encode<E: Encoder<Buffer = B>>(
        &self,
        enc: &mut E,
        t: usize,
        rows: usize,
        attention: &AttentionPlan,
        readback: Readback,
    ) -> Result<()> {
        let (s, a, k) = (&self.shape, &self.acts, &self.kernels);
        let input = |offset| At { buffer: &self.inputs, offset };
        let u = |x: usize| x as u32; // every size was checked against 32 bits at load

        // Embedding.
        enc.set_kernel(&k.embed);
        enc.set_buffer(0, &self.weights.embed.buffer, 0, Access::Read);
        bind(enc, 1, input(self.layout.ids), Access::Read);
        enc.set_buffer(2, &a.hidden, 0, Access::Write);
        enc.set_bytes(3, &words(&[u(s.hidden), u(s.vocab)]));
        enc.dispatch([t, 1, 1], [ROW_THREADS, 1, 1]);

        let norm_params = |gather: bool| {
            let mut p = words(&[u(s.hidden), u32::from(gather)]);
            p.extend(s.eps.to_le_bytes());
            p
        };
        let norm = |enc: &mut E, weight: &B, out: &B| {
            enc.set_kernel(&k.norm);
            enc.set_buffer(0, &a.hidden, 0, Access::Read);
            enc.set_buffer(1, weight, 0, Access::Read);
            // Unread without gathering; bound so every parameter has a buffer.
            bind(enc, 2, input(self.layout.rows), Access::Read);
            enc.set_buffer(3, out, 0, Access::Write);
            enc.set_bytes(4, &norm_params(false));
            enc.dispatch([t, 1, 1], [ROW_THREADS, 1, 1]);
        };
        let (qkv_rows, q_dim) = ((s.heads + 2 * s.kv_heads) * s.head_dim, s.heads * self.padded());
        for (layer, (k_cache, v_cache)) in self.weights.layers.iter().zip(&self.kv) {
            norm(enc, &layer.input_norm, &a.normed);
            let mut column = 0;
            for part in &layer.qkv {
                let rows = part.weight.rows;
                let out = Output { y: &a.qkv, stride: qkv_rows, offset: column };
                self.matmul(enc, part, &a.normed, out, (t, s.hidden, rows), MatmulMode::Store);
                column += rows;
            }

            enc.set_kernel(&k.rope);
            enc.set_buffer(0, &a.qkv, 0, Access::Read);
            enc.set_buffer(1, &self.weights.rope_cos, 0, Access::Read);
            enc.set_buffer(2, &self.weights.rope_sin, 0, Access::Read);
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
            let mut p = words(&[u(s.heads), u(s.kv_heads), u(s.head_dim), padded, u(num_slots), head_norm]);
            p.extend(s.eps.to_le_bytes());
            enc.set_bytes(10, &p);
            enc.dispatch([s.heads + 2 * s.kv_heads, t, 1], [32, 1, 1]);

            attention.encode(
                enc,
                AttentionBuffers {
                    q: At { buffer: &a.q, offset: 0 },
                    k_cache: At { buffer: k_cache, offset: 0 },
                    v_cache: At { buffer: v_cache, offset: 0 },
                    out: At { buffer: &a.attn, offset: 0 },
                    meta: &self.meta,
                    scratch: self.scratch.as_ref(),
                },
            );
            self.matmul(
                enc,
                &layer.o_proj,
                &a.attn,
                Output::whole(&a.hidden, s.hidden),
                (t, q_dim, s.hidden),
                MatmulMode::Accumulate,
            );
            norm(enc, &layer.post_norm, &a.normed);
            self.matmul(
                enc,
                &layer.gate_up,
                &a.normed,
                Output::whole(&a.act, s.intermediate),
                (t, s.hidden, s.intermediate),
                MatmulMode::Swiglu,
            );
            self.matmul(
                enc,
                &layer.down,
                &a.act,
                Output::whole(&a.hidden, s.hidden),
                (t, s.intermediate, s.hidden),
                MatmulMode::Accumulate,
            );
        }
        if rows == 0 {
            return Ok(());
        }

        // The final norm of the wanted rows only, then lm_head.
        enc.set_kernel(&k.norm);
        enc.set_buffer(0, &a.hidden, 0, Access::Read);
        enc.set_buffer(1, &self.weights.final_norm, 0, Access::Read);
        bind(enc, 2, input(self.layout.rows), Access::Read);
        enc.set_buffer(3, &a.head_in, 0, Access::Write);
        enc.set_bytes(4, &norm_params(true));
        enc.dispatch([rows, 1, 1], [ROW_THREADS, 1, 1]);
        let head = Linear { weight: self.weights.lm_head.clone(), bias: None };
        self.matmul(
            enc,
            &head,
            &a.head_in,
            Output::whole(&a.logits, s.vocab),
            (rows, s.hidden, s.vocab),
            MatmulMode::Store,
        );

        if readback == Readback::Greedy {
            enc.set_kernel(&k.argmax);
            enc.set_buffer(0, &a.logits, 0, Access::Read);
            enc.set_buffer(1, &a.tokens, 0, Access::Write);
            enc.set_bytes(2, &words(&[u(s.vocab)]));
            enc.dispatch([rows, 1, 1], [ROW_THREADS, 1, 1]);
        }
        Ok(())
    }

    /// `y (+)= x W^T (+ b)` over `t` tokens, `(t, in, out)`.
    fn matmul<E: Encoder<Buffer = B>>(
        &self,
        enc: &mut E,
        linear: &Linear<B>,
        x: &B,
        y: Output<'_, B>,
        (t, inp, out): (usize, usize, usize),
        mode: MatmulMode,
    ) {
        enc.set_kernel(self.kernels.matmul(linear.weight.format));
        enc.set_buffer(0, x, 0, Access::Read);
        enc.set_buffer(1, &linear.weight.buffer, 0, Access::Read);
        // Unread without a bias; bound to x then (f32, aligned).
        enc.set_buffer(2, linear.bias.as_ref().unwrap_or(x), 0, Access::Read);
        enc.set_buffer(3, y.y, 0, Access::Write);
        let has_bias = u32::from(linear.bias.is_some());
        let (stride, offset) = (y.stride as u32, y.offset as u32);
        enc.set_bytes(4, &words(&[t as u32, inp as u32, out as u32, mode as u32, has_bias, stride, offset]));
        enc.dispatch([out.div_ceil(MATMUL_ROWS), t.div_ceil(MATMUL_TOKENS), 1], [MATMUL_SIMDS * 32, 1, 1]);
    }
}

/// Where a matmul writes: columns `offset..offset + out` of rows of `stride`.
struct Output<'a, B> {
    y: &'a B,
    stride: usize,
    offset: usize,
}

impl<'a, B> Output<'a, B> {
    fn whole(y: &'a B, width: usize) -> Self {
        Self { y, stride: width, offset: 0 }
    }
}

/// The matmul's epilogue (`kMode*` in model.metal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MatmulMode {
    Store = 0,
    Accumulate = 1,
    Swiglu = 2,
}

fn bind<E: Encoder>(enc: &mut E, index: usize, at: At<'_, E::Buffer>, access: Access) {
    enc.set_buffer(index, at.buffer, at.offset, access);
}

/// The dispatches of a step of `layers` layers whose attention takes
/// `attention` dispatches per layer, with `rows` wanted rows.
pub fn dispatches_per_step(layers: usize, attention: usize, rows: usize, readback: Readback) -> usize {
    let head = if rows == 0 { 0 } else { 2 + usize::from(readback == Readback::Greedy) };
    1 + layers * (7 + attention) + head
}
