//! The Metal step plan (`kernels::metal::step`) run whole by the CPU
//! emulator, against a naive f32 reference of the same model written out
//! here: a prefill of several sequences (one split into chunks), then
//! decode steps, with and without Qwen3's head norm, biases, f16 or bf16
//! weights, GGML blocks, partial rotary embeddings and mixtures of experts
//! (softmax or sigmoid routers, group limits, shared experts). It also holds the plan to its promises: no allocation
//! after load, one command buffer per step, and the dispatch count
//! docs/ARCHITECTURE.md states.
#![cfg(feature = "metal-emulated")]

use candle_core::DType;
use kernels::AttentionMetadata;
use kernels::metal::emulated::EmulatedGpu;
use kernels::metal::model::quantize;
use kernels::metal::plan::Allocator;
use kernels::metal::step::{
    Experts, FeedForward, Gate, LayerWeights, Linear, Matrix, ModelShape, ModelWeights, OutputHead, Readback, Routing,
    SampleRow, StepInput, StepInputs, StepLimits, StepOutput, StepPlan, TokenEdit, WeightFormat, dispatches_per_step,
};

mod common;

/// A deterministic pseudo-random stream in [-a, a].
struct Rng(u64);

impl Rng {
    fn next(&mut self, a: f32) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
    fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.next(a)).collect()
    }
}

/// Rounds like the weight dtype does, so the reference sees the same weights.
fn round(dtype: DType, v: &[f32]) -> Vec<f32> {
    match dtype {
        DType::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        DType::BF16 => v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
        _ => v.to_vec(),
    }
}

fn bytes(dtype: DType, v: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F16 => v.iter().flat_map(|&x| half::f16::from_f32(x).to_bits().to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes()).collect(),
        _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

#[derive(Clone)]
struct RefLinear {
    /// The weights as the GPU sees them (rounded or dequantized).
    w: Vec<f32>,
    /// What is uploaded, in `format`.
    bytes: Vec<u8>,
    format: WeightFormat,
    b: Option<Vec<f32>>,
    out: usize,
    inp: usize,
}

impl RefLinear {
    fn new(rng: &mut Rng, out: usize, inp: usize, bias: bool, format: WeightFormat) -> Self {
        let raw = rng.vec(out * inp, 1.0 / (inp as f32).sqrt());
        let (bytes, w) = match format {
            WeightFormat::F32 => (bytes(DType::F32, &raw), raw),
            WeightFormat::F16 => (bytes(DType::F16, &raw), round(DType::F16, &raw)),
            WeightFormat::BF16 => (bytes(DType::BF16, &raw), round(DType::BF16, &raw)),
            blocks => quantize(blocks, &raw, out, inp).unwrap(),
        };
        Self { w, bytes, format, b: bias.then(|| rng.vec(out, 0.1)), out, inp }
    }
    fn apply(&self, x: &[f32]) -> Vec<f32> {
        (0..self.out)
            .map(|n| {
                let dot: f32 = (0..self.inp).map(|k| self.w[n * self.inp + k] * x[k]).sum();
                dot + self.b.as_ref().map_or(0.0, |b| b[n])
            })
            .collect()
    }
}

struct RefLayer {
    input_norm: Vec<f32>,
    /// q and k stacked, then v (which a GGUF file may store apart).
    qk: RefLinear,
    v: RefLinear,
    head_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: RefLinear,
    post_norm: Vec<f32>,
    mlp: RefMlp,
    window: Option<usize>,
    sinks: Option<Vec<f32>>,
    /// This layer's own RoPE tables (cos, sin), else the model's.
    rope: Option<(Vec<f32>, Vec<f32>)>,
    /// Gemma's norms of the attention's and the MLP's outputs.
    out_norms: Option<(Vec<f32>, Vec<f32>)>,
}

enum RefMlp {
    Dense { gate_up: RefLinear, down: RefLinear },
    Experts(RefExperts),
}

struct RefExperts {
    /// `[experts, hidden]`, f32.
    router: RefLinear,
    correction: Option<Vec<f32>>,
    /// Each expert's `[2 I, hidden]` and `[hidden, I]`.
    experts: Vec<(RefLinear, RefLinear)>,
    shared: Option<(RefLinear, RefLinear)>,
    routing: Routing,
}

/// A gated MLP: down(act(gate x) * up x), in f64 where the gate is.
fn gated_mlp(gate_up: &RefLinear, down: &RefLinear, x: &[f32], gate: Gate) -> Vec<f32> {
    let gu = gate_up.apply(x);
    let i = gate_up.out / 2;
    let act: Vec<f32> = (0..i)
        .map(|n| {
            let (g, u) = (f64::from(gu[n]), f64::from(gu[i + n]));
            (match gate {
                Gate::Silu => g / (1.0 + (-g).exp()) * u,
                Gate::GeluTanh => {
                    0.5 * g * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3))).tanh()) * u
                }
                Gate::ClampedSwiglu { limit } => {
                    let (l, g) = (f64::from(limit), g.min(f64::from(limit)));
                    (u.clamp(-l, l) + 1.0) * g / (1.0 + (-1.702 * g).exp())
                }
            }) as f32
        })
        .collect();
    down.apply(&act)
}

impl RefExperts {
    /// The kept experts (best first) and their weights, as transformers routes.
    fn route(&self, x: &[f32]) -> Vec<(usize, f32)> {
        let r = self.routing;
        let logits = self.router.apply(x);
        let scores: Vec<f32> = if r.sigmoid {
            logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect()
        } else {
            let m = logits.iter().copied().fold(f32::MIN, f32::max);
            let e: Vec<f32> = logits.iter().map(|&l| (l - m).exp()).collect();
            let z: f32 = e.iter().sum();
            e.iter().map(|v| v / z).collect()
        };
        let mut choice: Vec<f32> = match &self.correction {
            Some(c) => scores.iter().zip(c).map(|(s, c)| s + c).collect(),
            None => scores.clone(),
        };
        if r.groups_kept < r.groups {
            let size = r.experts / r.groups;
            let rank = |g: &[f32]| {
                let mut v = g.to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v.iter().take(2).sum::<f32>()
            };
            let group_scores: Vec<f32> = choice.chunks(size).map(rank).collect();
            let mut order: Vec<usize> = (0..r.groups).collect();
            order.sort_by(|&a, &b| group_scores[b].total_cmp(&group_scores[a]).then(a.cmp(&b)));
            for &g in &order[r.groups_kept..] {
                choice[g * size..][..size].fill(0.0);
            }
        }
        let mut kept: Vec<usize> = (0..r.experts).collect();
        kept.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
        kept.truncate(r.top_k);
        let total: f32 = kept.iter().map(|&e| scores[e]).sum();
        kept.iter().map(|&e| (e, if r.norm_topk { scores[e] / total } else { scores[e] } * r.scale)).collect()
    }

    fn apply(&self, x: &[f32], gate: Gate) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        for (e, w) in self.route(x) {
            let (gate_up, down) = &self.experts[e];
            out.iter_mut().zip(gated_mlp(gate_up, down, x, gate)).for_each(|(o, y)| *o += w * y);
        }
        if let Some((gate_up, down)) = &self.shared {
            out.iter_mut().zip(gated_mlp(gate_up, down, x, gate)).for_each(|(o, y)| *o += y);
        }
        out
    }
}

/// A mixture of experts in the test model's last layer.
#[derive(Clone, Copy)]
struct MoeSpec {
    routing: Routing,
    correction: bool,
    /// A shared expert of this width.
    shared: Option<usize>,
    /// Biases on the router and every expert's projections (gpt-oss).
    biases: bool,
}

/// What a test model has beyond a dense Llama.
#[derive(Clone, Copy)]
struct Extras {
    moe: Option<MoeSpec>,
    /// RoPE on the first dims of each head only.
    rotary_dim: Option<usize>,
    /// Each layer's attention window.
    windows: [Option<usize>; 2],
    /// gpt-oss's attention sinks on every layer.
    sinks: bool,
    /// Gemma: output norms of dense sublayers, layer 0 with RoPE tables of
    /// its own, embeddings scaled, q.k scaled by 1/sqrt(24).
    gemma: bool,
    activation: Gate,
}

impl Default for Extras {
    fn default() -> Self {
        Self { moe: None, rotary_dim: None, windows: [None; 2], sinks: false, gemma: false, activation: Gate::Silu }
    }
}

/// RoPE tables `[positions, rotary_dim / 2]` of base `base`.
fn rope_tables(positions: usize, rotary_dim: usize, base: f64) -> (Vec<f32>, Vec<f32>) {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for pos in 0..positions {
        for i in 0..rotary_dim / 2 {
            let angle = pos as f64 / base.powf(2.0 * i as f64 / rotary_dim as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

struct RefModel {
    shape: ModelShape,
    embed: Vec<f32>,
    layers: Vec<RefLayer>,
    final_norm: Vec<f32>,
    lm_head: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    dtype: DType,
}

/// The formats of a test model's weights.
#[derive(Clone, Copy)]
struct Formats {
    /// Embedding and lm_head.
    dense: DType,
    /// qk, gate/up and down.
    linear: WeightFormat,
    /// v and o_proj.
    v_o: WeightFormat,
}

impl Formats {
    fn all(dtype: DType) -> Self {
        let f = WeightFormat::of_dtype(dtype).unwrap();
        Self { dense: dtype, linear: f, v_o: f }
    }
}

fn rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * inv * w).collect()
}

impl RefModel {
    fn new(shape: ModelShape, layers: usize, head_norm: bool, bias: bool, formats: Formats, seed: u64) -> Self {
        Self::with_extras(shape, layers, (head_norm, bias), formats, Extras::default(), seed)
    }

    /// The last layer's MLP a mixture of experts under `extras.moe`.
    fn with_extras(
        shape: ModelShape,
        layers: usize,
        (head_norm, bias): (bool, bool),
        formats: Formats,
        extras: Extras,
        seed: u64,
    ) -> Self {
        let dtype = formats.dense;
        let mut rng = Rng(seed);
        let ModelShape { hidden, intermediate, heads, kv_heads, head_dim, vocab, rotary_dim, .. } = shape;
        let norm = |rng: &mut Rng, n: usize| (0..n).map(|_| 1.0 + rng.next(0.2)).collect::<Vec<_>>();
        let dense = |rng: &mut Rng, width: usize| {
            (
                RefLinear::new(rng, 2 * width, hidden, false, formats.linear),
                RefLinear::new(rng, hidden, width, false, formats.linear),
            )
        };
        let layers = (0..layers)
            .map(|l| RefLayer {
                input_norm: norm(&mut rng, hidden),
                qk: RefLinear::new(&mut rng, (heads + kv_heads) * head_dim, hidden, bias, formats.linear),
                v: RefLinear::new(&mut rng, kv_heads * head_dim, hidden, bias, formats.v_o),
                head_norm: head_norm.then(|| (norm(&mut rng, head_dim), norm(&mut rng, head_dim))),
                o: RefLinear::new(&mut rng, hidden, heads * head_dim, false, formats.v_o),
                post_norm: norm(&mut rng, hidden),
                mlp: match extras.moe {
                    Some(spec) if l + 1 == layers => {
                        let r = spec.routing;
                        // A router three times as sharp as the others:
                        // choices apart by far more than rounding.
                        let mut router = RefLinear::new(&mut rng, r.experts, hidden, spec.biases, WeightFormat::F32);
                        router.w.iter_mut().for_each(|w| *w *= 3.0);
                        router.bytes = bytes(DType::F32, &router.w);
                        let expert = |rng: &mut Rng| {
                            let width = r.expert_intermediate;
                            (
                                RefLinear::new(rng, 2 * width, hidden, spec.biases, formats.linear),
                                RefLinear::new(rng, hidden, width, spec.biases, formats.linear),
                            )
                        };
                        RefMlp::Experts(RefExperts {
                            router,
                            correction: spec.correction.then(|| rng.vec(r.experts, 0.3)),
                            experts: (0..r.experts).map(|_| expert(&mut rng)).collect(),
                            shared: spec.shared.map(|w| dense(&mut rng, w)),
                            routing: r,
                        })
                    }
                    _ => {
                        let (gate_up, down) = dense(&mut rng, intermediate);
                        RefMlp::Dense { gate_up, down }
                    }
                },
                window: extras.windows[l],
                sinks: extras.sinks.then(|| rng.vec(heads, 2.0)),
                rope: (extras.gemma && l == 0).then(|| rope_tables(shape.max_positions, rotary_dim, 500.0)),
                out_norms: (extras.gemma && !(extras.moe.is_some() && l + 1 == layers))
                    .then(|| (norm(&mut rng, hidden), norm(&mut rng, hidden))),
            })
            .collect();
        let (cos, sin) = rope_tables(shape.max_positions, rotary_dim, 10000.0);
        Self {
            shape,
            embed: round(dtype, &rng.vec(vocab * hidden, 1.0)),
            layers,
            final_norm: norm(&mut rng, hidden),
            lm_head: round(dtype, &rng.vec(vocab * hidden, 1.0 / (hidden as f32).sqrt())),
            cos,
            sin,
            dtype,
        }
    }

    fn rope(&self, (cos, sin): (&[f32], &[f32]), x: &mut [f32], pos: usize) {
        let half = self.shape.rotary_dim / 2;
        for j in 0..half {
            let (c, s) = (cos[pos * half + j], sin[pos * half + j]);
            let (a, b) = (x[j], x[j + half]);
            x[j] = a * c - b * s;
            x[j + half] = b * c + a * s;
        }
    }

    /// Logits after each token of `tokens` (positions 0..), by full causal attention.
    fn logits(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let s = &self.shape;
        let (h, kvh, d) = (s.heads, s.kv_heads, s.head_dim);
        let embed = |t: u32| self.embed[t as usize * s.hidden..][..s.hidden].iter().map(|v| v * s.embed_scale);
        let mut hidden: Vec<Vec<f32>> = tokens.iter().map(|&t| embed(t).collect()).collect();
        for layer in &self.layers {
            let tables = layer.rope.as_ref().map_or((&self.cos[..], &self.sin[..]), |(c, s)| (c, s));
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (pos, x) in hidden.iter().enumerate() {
                let normed = rms(x, &layer.input_norm, s.eps);
                let mut qkv = layer.qk.apply(&normed);
                qkv.extend(layer.v.apply(&normed));
                let head = |i: usize| qkv[i * d..][..d].to_vec();
                let norm = |v: Vec<f32>, w: Option<&Vec<f32>>| w.map_or(v.clone(), |w| rms(&v, w, s.eps));
                let mut q: Vec<Vec<f32>> =
                    (0..h).map(|i| norm(head(i), layer.head_norm.as_ref().map(|n| &n.0))).collect();
                let mut k: Vec<Vec<f32>> =
                    (h..h + kvh).map(|i| norm(head(i), layer.head_norm.as_ref().map(|n| &n.1))).collect();
                q.iter_mut().chain(k.iter_mut()).for_each(|x| self.rope(tables, x, pos));
                qs.push(q);
                ks.push(k);
                vs.push((h + kvh..h + 2 * kvh).map(head).collect::<Vec<_>>());
            }
            for (pos, x) in hidden.iter_mut().enumerate() {
                let mut attn = Vec::new();
                // The keys this position sees (its window), in f64.
                let first = layer.window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for (head, q) in qs[pos].iter().enumerate() {
                    let g = head / (h / kvh);
                    let scores: Vec<f64> = (first..=pos)
                        .map(|j| {
                            f64::from(q.iter().zip(&ks[j][g]).map(|(a, b)| a * b).sum::<f32>() * s.attention_scale)
                        })
                        .collect();
                    let sink = layer.sinks.as_ref().map(|sinks| f64::from(sinks[head]));
                    let m = scores.iter().copied().chain(sink).fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - m).exp());
                    let value = |i: usize| {
                        e.iter().enumerate().map(|(n, e)| e / z * f64::from(vs[first + n][g][i])).sum::<f64>()
                    };
                    attn.extend((0..d).map(|i| value(i) as f32));
                }
                let add = |x: &mut Vec<f32>, y: Vec<f32>, norm: Option<&Vec<f32>>| {
                    let y = norm.map_or(y.clone(), |w| rms(&y, w, s.eps));
                    x.iter_mut().zip(y).for_each(|(x, y)| *x += y);
                };
                add(x, layer.o.apply(&attn), layer.out_norms.as_ref().map(|n| &n.0));
                let normed = rms(x, &layer.post_norm, s.eps);
                let down = match &layer.mlp {
                    RefMlp::Dense { gate_up, down } => gated_mlp(gate_up, down, &normed, s.activation),
                    RefMlp::Experts(experts) => experts.apply(&normed, s.activation),
                };
                add(x, down, layer.out_norms.as_ref().map(|n| &n.1));
            }
        }
        hidden
            .iter()
            .map(|x| {
                let n = rms(x, &self.final_norm, s.eps);
                (0..s.vocab).map(|v| (0..s.hidden).map(|k| self.lm_head[v * s.hidden + k] * n[k]).sum()).collect()
            })
            .collect()
    }

    fn upload(&self, gpu: &mut EmulatedGpu) -> ModelWeights<kernels::metal::emulated::EmuBuffer> {
        let f32s = |gpu: &mut EmulatedGpu, v: &[f32]| gpu.upload(&bytes(DType::F32, v)).unwrap();
        let matrix = |gpu: &mut EmulatedGpu, v: &[f32], rows: usize, cols: usize| Matrix {
            buffer: gpu.upload(&bytes(self.dtype, v)).unwrap(),
            format: WeightFormat::of_dtype(self.dtype).unwrap(),
            rows,
            cols,
        };
        let linear = |gpu: &mut EmulatedGpu, l: &RefLinear| Linear {
            weight: Matrix { buffer: gpu.upload(&l.bytes).unwrap(), format: l.format, rows: l.out, cols: l.inp },
            bias: l.b.as_ref().map(|b| f32s(gpu, b)),
        };
        // Every expert's matrix of one projection in one buffer, expert-major
        // (and their biases likewise).
        let stacked = |gpu: &mut EmulatedGpu, parts: Vec<&RefLinear>| {
            let bytes: Vec<u8> = parts.iter().flat_map(|l| l.bytes.iter().copied()).collect();
            let (format, cols) = (parts[0].format, parts[0].inp);
            let rows = parts.iter().map(|l| l.out).sum();
            let bias = parts[0].b.is_some().then(|| {
                let all: Vec<f32> = parts.iter().flat_map(|l| l.b.clone().unwrap()).collect();
                f32s(gpu, &all)
            });
            Linear { weight: Matrix { buffer: gpu.upload(&bytes).unwrap(), format, rows, cols }, bias }
        };
        let mlp = |gpu: &mut EmulatedGpu, mlp: &RefMlp| match mlp {
            RefMlp::Dense { gate_up, down } => {
                FeedForward::Dense { gate_up: linear(gpu, gate_up), down: linear(gpu, down) }
            }
            RefMlp::Experts(x) => FeedForward::Experts(Experts {
                router: linear(gpu, &x.router),
                correction: x.correction.as_ref().map(|c| f32s(gpu, c)),
                gate_up: stacked(gpu, x.experts.iter().map(|e| &e.0).collect()),
                down: stacked(gpu, x.experts.iter().map(|e| &e.1).collect()),
                shared: x.shared.as_ref().map(|(gu, d)| (linear(gpu, gu), linear(gpu, d))),
                routing: x.routing,
            }),
        };
        let s = &self.shape;
        ModelWeights {
            embed: Some(matrix(gpu, &self.embed, s.vocab, s.hidden)),
            layers: self
                .layers
                .iter()
                .map(|l| LayerWeights {
                    input_norm: f32s(gpu, &l.input_norm),
                    qkv: vec![linear(gpu, &l.qk), linear(gpu, &l.v)],
                    head_norm: l.head_norm.as_ref().map(|(q, k)| (f32s(gpu, q), f32s(gpu, k))),
                    o_proj: linear(gpu, &l.o),
                    post_norm: f32s(gpu, &l.post_norm),
                    mlp: mlp(gpu, &l.mlp),
                    window: l.window,
                    sinks: l.sinks.as_ref().map(|v| f32s(gpu, v)),
                    rope: l.rope.as_ref().map(|(c, s)| (f32s(gpu, c), f32s(gpu, s))),
                    attn_out_norm: l.out_norms.as_ref().map(|n| f32s(gpu, &n.0)),
                    mlp_out_norm: l.out_norms.as_ref().map(|n| f32s(gpu, &n.1)),
                })
                .collect(),
            head: Some(OutputHead {
                final_norm: f32s(gpu, &self.final_norm),
                lm_head: matrix(gpu, &self.lm_head, s.vocab, s.hidden),
            }),
            rope_cos: f32s(gpu, &self.cos),
            rope_sin: f32s(gpu, &self.sin),
        }
    }
}

const BLOCK: usize = 4;

/// A step over `seqs`: (sequence index, tokens computed before, new tokens).
fn step_inputs(seqs: &[(usize, usize, &[u32])]) -> (Vec<u32>, Vec<u32>, AttentionMetadata, Vec<u32>) {
    step_inputs_in(seqs, 16)
}

/// As [`step_inputs`], each sequence owning `blocks` blocks.
fn step_inputs_in(seqs: &[(usize, usize, &[u32])], blocks: usize) -> (Vec<u32>, Vec<u32>, AttentionMetadata, Vec<u32>) {
    let mut meta = AttentionMetadata { query_start_loc: vec![0], block_size: BLOCK, ..AttentionMetadata::default() };
    let (mut ids, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
    for &(seq, done, new) in seqs {
        // Sequence s owns blocks s*blocks.. in reverse order: scattered, not contiguous.
        let table: Vec<u32> = (0..blocks).map(|b| (seq * blocks + blocks - 1 - b) as u32).collect();
        for (i, &t) in new.iter().enumerate() {
            let pos = done + i;
            ids.push(t);
            positions.push(pos as u32);
            meta.slot_mapping.push(table[pos / BLOCK] * BLOCK as u32 + (pos % BLOCK) as u32);
        }
        meta.query_start_loc.push(ids.len() as u32);
        meta.context_lens.push((done + new.len()) as u32);
        meta.block_tables.push(table);
        rows.push(ids.len() as u32 - 1);
    }
    (ids, positions, meta, rows)
}

fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * (1.0 + w.abs()), "{what}: logit {i}: {g} vs reference {w}");
    }
}

fn check_model(head_norm: bool, bias: bool, dtype: DType, cache: DType) {
    check_model_with(head_norm, bias, Formats::all(dtype), cache, 64)
}

fn check_model_with(head_norm: bool, bias: bool, formats: Formats, cache: DType, hidden: usize) {
    check_model_extras(head_norm, bias, formats, cache, hidden, Extras::default())
}

fn check_model_extras(head_norm: bool, bias: bool, formats: Formats, cache: DType, hidden: usize, extras: Extras) {
    if !metal_emu::available() {
        return common::metal_unavailable("the Metal emulator is not built for this target");
    }
    let shape = ModelShape {
        hidden,
        // Float rows of a length past whole 32-weight chunks (the tail);
        // whole blocks otherwise.
        intermediate: match formats.linear {
            f if f.is_float() => hidden + 40,
            WeightFormat::Q4K | WeightFormat::Q6K => hidden,
            _ => hidden + 32,
        },
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        rotary_dim: extras.rotary_dim.unwrap_or(32),
        vocab: 50,
        eps: 1e-6,
        max_positions: 64,
        attention_scale: if extras.gemma { 24f32.sqrt().recip() } else { 32f32.sqrt().recip() },
        embed_scale: if extras.gemma { (hidden as f32).sqrt() } else { 1.0 },
        activation: extras.activation,
    };
    let model = RefModel::with_extras(shape, 2, (head_norm, bias), formats, extras, 7);
    let mut gpu = EmulatedGpu::new().unwrap();
    let limits = StepLimits {
        max_tokens: 16,
        max_seqs: 4,
        max_logit_rows: 4,
        max_sampled_rows: 4,
        max_model_len: 64,
        num_blocks: 64,
        block_size: BLOCK,
    };
    let weights = model.upload(&mut gpu);
    let plan = StepPlan::new(&mut gpu, shape, weights, limits, cache).unwrap();
    gpu.prepare(plan.kernels()).unwrap();
    let loaded = gpu.counters();

    let a: Vec<u32> = vec![3, 17, 4, 42, 8, 8, 1, 30, 22, 5];
    let b: Vec<u32> = vec![9, 2, 33];
    let want_a = model.logits(&a);
    let want_b = model.logits(&b);
    let tol = if cache == DType::F16 { 2e-2 } else { 2e-4 };
    let vocab = shape.vocab;
    let logits = |out: StepOutput| -> Vec<f32> {
        let StepOutput::Logits(logits) = out else { panic!("logits were asked for") };
        logits
    };
    let edits = [TokenEdit { token: 3, banned: false, bias: Some(2.0), seen: true, count: 2 }];
    let nucleus = SampleRow {
        temperature: 0.7,
        top_k: 9,
        top_p: 0.8,
        min_p: 0.05,
        repetition_penalty: 1.2,
        frequency_penalty: 0.5,
        presence_penalty: 0.1,
        uniform: 0.4,
        top_logprobs: Some(5),
        allowed: Some(&[u32::MAX, 0xff]),
        edits: &edits,
    };
    let sample_rows = [[SampleRow::GREEDY], [nucleus]];
    let run = |gpu: &mut EmulatedGpu, seqs: &[(usize, usize, &[u32])], readback| {
        let (ids, positions, meta, rows) = step_inputs(seqs);
        let inputs =
            StepInputs { input: StepInput::Tokens(&ids), positions: &positions, meta: &meta, logit_rows: &rows };
        plan.run(gpu, &inputs, readback).unwrap()
    };
    // Step 1: a's first 6 tokens (a chunk) beside all of b.
    let out = logits(run(&mut gpu, &[(0, 0, &a[..6]), (1, 0, &b)], Readback::Logits));
    close("a chunk", &out[..vocab], &want_a[5], tol);
    close("b prompt", &out[vocab..], &want_b[2], tol);
    // Step 2: the rest of a's prompt; step 3 on: decode a token at a time.
    let out = logits(run(&mut gpu, &[(0, 6, &a[6..9])], Readback::Logits));
    close("a rest", &out, &want_a[8], tol);
    let before = gpu.counters();
    let out = logits(run(&mut gpu, &[(0, 9, &a[9..])], Readback::Logits));
    close("a decode", &out, &want_a[9], tol);
    let after = gpu.counters();
    assert_eq!(after.allocations, loaded.allocations, "a step allocated");
    assert_eq!(after.command_buffers - before.command_buffers, 1, "one command buffer per step");
    // q and k apart from v: one more matmul per layer than a stacked qkv; a
    // mixture of experts takes 4 more (6 with a shared expert).
    let experts = extras.moe.map_or(0, |m| if m.shared.is_some() { 6 } else { 4 });
    // Gemma's output norms: a dispatch each.
    let experts = experts + 2 * model.layers.iter().filter(|l| l.out_norms.is_some()).count();
    assert_eq!(after.dispatches - before.dispatches, dispatches_per_step(2, 1, 1, Readback::Logits) + 2 + experts);
    // Sampled on the GPU: greedy, the argmax of the same logits; one more
    // dispatch whatever the parameters (what the draws are is
    // worker/tests/metal_sampling.rs's).
    let best = (0..vocab).max_by(|&i, &j| out[i].total_cmp(&out[j]).then(j.cmp(&i))).unwrap();
    for rows in &sample_rows {
        let params = rows[0];
        let before = gpu.counters();
        let StepOutput::Sampled(sampled) = run(&mut gpu, &[(0, 9, &a[9..])], Readback::Sample(rows)) else {
            panic!("draws were asked for")
        };
        let after = gpu.counters();
        assert_eq!(after.allocations, loaded.allocations, "a sampling step allocated");
        assert_eq!(after.command_buffers - before.command_buffers, 1, "one command buffer per sampling step");
        let sample = dispatches_per_step(2, 1, 1, Readback::Sample(rows)) + 2 + experts;
        assert_eq!(after.dispatches - before.dispatches, sample);
        assert_eq!(sample, dispatches_per_step(2, 1, 1, Readback::Logits) + 3 + experts);
        if params.temperature == 0.0 {
            assert_eq!(sampled[0].token as usize, best);
        } else {
            assert!(sampled[0].token < 40, "a token the mask allows: {}", sampled[0].token);
            assert_eq!(sampled[0].logprobs.as_ref().map(|l| l.top.len()), Some(5));
        }
    }
}

#[test]
fn the_step_plan_matches_a_naive_model() {
    check_model(false, false, DType::F32, DType::F32);
}

#[test]
fn the_step_plan_matches_with_head_norms_biases_and_an_f16_cache() {
    check_model(true, true, DType::F32, DType::F16);
}

#[test]
fn the_step_plan_matches_with_f16_and_bf16_weights() {
    check_model(false, true, DType::F16, DType::F32);
    check_model(true, false, DType::BF16, DType::F32);
}

#[test]
fn the_step_plan_reads_q8_0_and_q4_0_blocks() {
    let f = |linear, v_o| Formats { dense: DType::F32, linear, v_o };
    check_model_with(false, true, f(WeightFormat::Q8_0, WeightFormat::Q4_0), DType::F32, 64);
    check_model_with(true, false, f(WeightFormat::Q4_0, WeightFormat::Q8_0), DType::F16, 64);
}

#[test]
fn the_step_plan_reads_q4_k_and_q6_k_blocks() {
    // As in a Q4_K_M file: Q4_K mostly, Q6_K for v (o_proj's 128 inputs are
    // not a whole super-block: Q8_0, as llama.cpp falls back).
    let f = |linear, v_o| Formats { dense: DType::F16, linear, v_o };
    check_model_with(false, false, f(WeightFormat::Q4K, WeightFormat::Q8_0), DType::F32, 256);
    check_model_with(true, true, f(WeightFormat::Q6K, WeightFormat::Q8_0), DType::F32, 256);
}

fn routing(experts: usize, top_k: usize, width: usize) -> Routing {
    Routing {
        experts,
        top_k,
        expert_intermediate: width,
        sigmoid: false,
        norm_topk: false,
        groups: 1,
        groups_kept: 1,
        scale: 1.0,
    }
}

/// Mixtral's and Qwen3-MoE's routing (softmax, top-k, renormalised or
/// not) over float and block experts: the chosen experts' matrices only,
/// pairs grouped by expert, each token's weighted sum.
#[test]
fn the_step_plan_runs_mixtures_of_experts() {
    let f = |linear| Formats { dense: DType::F32, linear, v_o: WeightFormat::F32 };
    let moe = |routing| Extras {
        moe: Some(MoeSpec { routing, correction: false, shared: None, biases: false }),
        ..Extras::default()
    };
    let renormalised = Routing { norm_topk: true, ..routing(8, 2, 40) };
    check_model_extras(false, false, f(WeightFormat::F32), DType::F32, 64, moe(renormalised));
    // Top-4 of 16, not renormalised, f16 experts; every token on every expert.
    check_model_extras(true, false, f(WeightFormat::F16), DType::F32, 64, moe(routing(16, 4, 24)));
    check_model_extras(false, false, f(WeightFormat::F32), DType::F32, 64, moe(routing(4, 4, 24)));
    // Blocks, as a GGUF file's experts: top-1 of 5 (a tile a token), Q8_0 and Q4_K.
    check_model_extras(false, true, f(WeightFormat::Q8_0), DType::F16, 64, moe(routing(5, 1, 64)));
    let q4k = Routing { norm_topk: true, ..routing(6, 3, 256) };
    check_model_extras(false, false, f(WeightFormat::Q4K), DType::F32, 256, moe(q4k));
}

/// GLM-4.5's (DeepSeek-V3's) routing: sigmoid scores, the choice made with
/// a correction bias from the best groups, weights renormalised and scaled;
/// a shared expert; half the head's dims rotated.
#[test]
fn the_step_plan_runs_glm_routing_shared_experts_and_partial_rotary() {
    let f = Formats::all(DType::F32);
    let glm = Routing { sigmoid: true, norm_topk: true, groups: 4, groups_kept: 2, scale: 2.5, ..routing(16, 3, 40) };
    let extras = Extras {
        moe: Some(MoeSpec { routing: glm, correction: true, shared: Some(48), biases: false }),
        rotary_dim: Some(16),
        ..Extras::default()
    };
    check_model_extras(false, true, f, DType::F32, 64, extras);
    // Ungrouped, and partial rotary on a dense model with head norms.
    let plain = Routing { groups: 1, groups_kept: 1, ..glm };
    let extras = Extras {
        moe: Some(MoeSpec { routing: plain, correction: true, shared: None, biases: false }),
        rotary_dim: Some(16),
        ..Extras::default()
    };
    check_model_extras(true, false, f, DType::F16, 64, extras);
    check_model_extras(true, true, f, DType::F32, 64, Extras { rotary_dim: Some(8), ..Extras::default() });
}

/// gpt-oss: attention sinks, a sliding layer beside a full one, biased
/// router and experts, the clamped SwiGLU (a limit small enough to clamp),
/// experts in f32 and in MXFP4 blocks.
#[test]
fn the_step_plan_runs_gpt_oss_layers() {
    let gpt_oss = Routing { norm_topk: true, ..routing(8, 4, 32) };
    let extras = Extras {
        moe: Some(MoeSpec { routing: gpt_oss, correction: false, shared: None, biases: true }),
        windows: [Some(3), None],
        sinks: true,
        activation: Gate::ClampedSwiglu { limit: 0.5 },
        ..Extras::default()
    };
    check_model_extras(false, true, Formats::all(DType::F32), DType::F32, 64, extras);
    let mxfp4 = Formats { dense: DType::F32, linear: WeightFormat::Mxfp4, v_o: WeightFormat::F32 };
    check_model_extras(false, true, mxfp4, DType::F16, 64, extras);
}

/// Gemma 3: output norms of both sublayers, GeGLU, q/k norms, scaled
/// embeddings, its own q.k scale, a local layer with its own window and
/// RoPE base beside a global one.
#[test]
fn the_step_plan_runs_gemma_layers() {
    let extras = Extras { gemma: true, windows: [Some(5), None], activation: Gate::GeluTanh, ..Extras::default() };
    check_model_extras(true, false, Formats::all(DType::F32), DType::F32, 64, extras);
    check_model_extras(true, false, Formats::all(DType::BF16), DType::F16, 64, extras);
}

/// A batch-1 decode step over a 600-token context (two attention
/// partitions) touches about what it must read: every weight and every K/V
/// of the context once, plus the activations. `bench --profile` prints the
/// same figure for a whole model.
#[test]
fn a_decode_step_reads_weights_and_kv_about_once() {
    if !metal_emu::available() {
        return common::metal_unavailable("the Metal emulator is not built for this target");
    }
    let shape = ModelShape {
        hidden: 256,
        intermediate: 768,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        rotary_dim: 64,
        vocab: 1024,
        eps: 1e-6,
        max_positions: 640,
        attention_scale: 64f32.sqrt().recip(),
        embed_scale: 1.0,
        activation: Gate::Silu,
    };
    let model = RefModel::new(shape, 2, true, false, Formats::all(DType::F16), 5);
    let mut gpu = EmulatedGpu::new().unwrap();
    let limits = StepLimits {
        max_tokens: 128,
        max_seqs: 2,
        max_logit_rows: 2,
        max_sampled_rows: 2,
        max_model_len: 640,
        num_blocks: 160,
        block_size: BLOCK,
    };
    let weights = model.upload(&mut gpu);
    let plan = StepPlan::new(&mut gpu, shape, weights, limits, DType::F32).unwrap();
    gpu.prepare(plan.kernels()).unwrap();
    let tokens: Vec<u32> = (0..601).map(|i| (i * 7 % 1024) as u32).collect();
    let step = |gpu: &mut EmulatedGpu, done: usize, new: &[u32]| {
        let (ids, positions, meta, rows) = step_inputs_in(&[(0, done, new)], 160);
        let inputs =
            StepInputs { input: StepInput::Tokens(&ids), positions: &positions, meta: &meta, logit_rows: &rows };
        plan.run(gpu, &inputs, Readback::Sample(&[SampleRow::GREEDY])).unwrap();
        plan.kv_read_bytes(&meta)
    };
    for start in (0..600).step_by(120) {
        step(&mut gpu, start, &tokens[start..start + 120]);
    }
    use kernels::metal::step::Gpu;
    gpu.count_traffic(true);
    let kv = step(&mut gpu, 600, &tokens[600..]);
    let touched = gpu.traffic_bytes().unwrap();
    let must = plan.weight_bytes() + kv;
    let ratio = touched as f64 / must as f64;
    eprintln!(
        "decode step: {touched} bytes touched, {must} must be read (weights {}, KV {kv}): {ratio:.3}x",
        plan.weight_bytes()
    );
    assert!(ratio <= 1.15, "{ratio:.3}x");
    assert!(ratio >= 0.99, "less than the weights and KV: {ratio:.3}x");
}

/// A pipeline of two stage plans (layers 0 and 1: the embedding on the
/// first, the head on the second) hands hidden states on and gives the
/// whole plan's logits, bit for bit, over a prefill and a decode step.
#[test]
fn stage_plans_chained_give_the_whole_plans_logits() {
    if !metal_emu::available() {
        return common::metal_unavailable("the Metal emulator is not built for this target");
    }
    let shape = ModelShape {
        hidden: 64,
        intermediate: 96,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        rotary_dim: 32,
        vocab: 50,
        eps: 1e-6,
        max_positions: 64,
        attention_scale: 32f32.sqrt().recip(),
        embed_scale: 1.0,
        activation: Gate::Silu,
    };
    let model = RefModel::new(shape, 2, true, false, Formats::all(DType::F32), 3);
    let mut gpu = EmulatedGpu::new().unwrap();
    let limits = StepLimits {
        max_tokens: 16,
        max_seqs: 2,
        max_logit_rows: 2,
        max_sampled_rows: 2,
        max_model_len: 64,
        num_blocks: 32,
        block_size: BLOCK,
    };
    let whole_weights = model.upload(&mut gpu);
    let first = ModelWeights { layers: whole_weights.layers[..1].to_vec(), head: None, ..whole_weights.clone() };
    let last = ModelWeights { embed: None, layers: whole_weights.layers[1..].to_vec(), ..whole_weights.clone() };
    let whole = StepPlan::new(&mut gpu, shape, whole_weights, limits, DType::F32).unwrap();
    let first = StepPlan::new(&mut gpu, shape, first, limits, DType::F32).unwrap();
    let last = StepPlan::new(&mut gpu, shape, last, limits, DType::F32).unwrap();
    for plan in [&whole, &first, &last] {
        gpu.prepare(plan.kernels()).unwrap();
    }
    let a: Vec<u32> = vec![3, 17, 4, 42, 8, 8, 1];
    for (done, new) in [(0, &a[..6]), (6, &a[6..])] {
        let (ids, positions, meta, rows) = step_inputs(&[(0, done, new)]);
        fn step<'a>(
            input: StepInput<'a>,
            positions: &'a [u32],
            meta: &'a AttentionMetadata,
            rows: &'a [u32],
        ) -> StepInputs<'a> {
            StepInputs { input, positions, meta, logit_rows: rows }
        }
        let step = |input, rows| step(input, &positions, &meta, rows);
        let want = whole.run(&mut gpu, &step(StepInput::Tokens(&ids), &rows), Readback::Logits).unwrap();
        // The first stage wants no rows: its hidden states go on.
        let StepOutput::Hidden(hidden) =
            first.run(&mut gpu, &step(StepInput::Tokens(&ids), &[]), Readback::Hidden).unwrap()
        else {
            panic!("hidden states were asked for")
        };
        assert_eq!(hidden.len(), ids.len() * shape.hidden);
        let got = last.run(&mut gpu, &step(StepInput::Hidden(&hidden), &rows), Readback::Logits).unwrap();
        assert_eq!(got, want, "a step from position {done}");
        // A stage refuses what it cannot start from.
        assert!(last.run(&mut gpu, &step(StepInput::Tokens(&ids), &rows), Readback::Logits).is_err());
        assert!(first.run(&mut gpu, &step(StepInput::Tokens(&ids), &rows), Readback::Logits).is_err());
    }
}
