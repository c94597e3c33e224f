// The model step on Metal, besides attention and its KV write: the token
// embedding, RMSNorm, the linear layers (GEMV for decode, a GEMM over tiles
// of 8 tokens for prefill) with their epilogues fused in, RoPE fused with
// the head norm and the KV cache write, and a mixture of experts' routing,
// grouping, grouped matmul (`matmul_id`) and weighted sum. Activations are
// f32 throughout; weights are f32, f16, bf16 or GGML blocks (Q8_0, Q4_0,
// Q4_K, Q6_K, MXFP4), widened in registers.
//
// What is fused, and why (each saves a dispatch and a round trip of the
// activations through device memory, as llama.cpp's Metal graph does):
// - the residual add goes into the epilogue of o_proj and down_proj, which
//   add their output to the residual stream in place (`kModeAccumulate`);
// - the gate's product (SwiGLU, GeGLU or gpt-oss's clamped SwiGLU) is the
//   epilogue of the stacked gate/up projection, which reads row n of gate
//   and of up together (`kModeSwiglu` and the other gated modes);
// - RoPE, the head norm and the cache write are one pass over the qkv row
//   (`rope_qkv_cache`), which leaves q for attention and K/V in their slots.
//
// The host side is kernels/src/metal/step/.

#include <metal_stdlib>
using namespace metal;

// Explicit instantiations name their host function with Metal attributes,
// which clang cannot parse in that position; the Linux syntax check's shim
// (shim/metal_shim.h) defines this macro empty.
#ifndef TINYVLLM_KERNEL
#define TINYVLLM_KERNEL(name) [[host_name(name)]] [[kernel]]
#endif

static constant constexpr const uint kModelSimdWidth = 32;
// Threads per threadgroup of the row kernels (embed, rms_norm).
static constant constexpr const uint kRowThreads = 256;
static constant constexpr const uint kRowSimds = kRowThreads / kModelSimdWidth;
// SIMD groups per matmul threadgroup, and output rows per SIMD group.
static constant constexpr const uint kMatmulSimds = 4;
static constant constexpr const uint kMatmulRowsPerSimd = 4;
// Tokens a matmul SIMD group accumulates at once: each weight element read
// serves this many tokens.
static constant constexpr const uint kMatmulTokens = 8;

// ---------------------------------------------------------------------------
// Embedding

struct EmbedParams {
  uint hidden;
  uint vocab;
  float scale;  // Gemma's sqrt(hidden); 1 for the others
};

// One threadgroup per token: out[t] = table[ids[t]] * scale, widened to f32.
template <typename W>
[[kernel]] void embed_rows(
    device const W* table [[buffer(0)]],  // [vocab, hidden]
    device const uint* ids [[buffer(1)]],  // [T]
    device float* out [[buffer(2)]],       // [T, hidden]
    constant EmbedParams& p [[buffer(3)]],
    uint token [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]]) {
  const uint id = ids[token];
  // The host checks ids against the vocabulary; the guard keeps a bad one
  // from reading past the table.
  if (id >= p.vocab) {
    return;
  }
  device const W* src = table + id * p.hidden;
  device float* dst = out + token * p.hidden;
  for (uint i = tid; i < p.hidden; i += kRowThreads) {
    dst[i] = float(src[i]) * p.scale;
  }
}

// ---------------------------------------------------------------------------
// RMSNorm

struct NormParams {
  uint dim;
  uint gather;      // 1: row r of the output normalises row rows[r] of x
  uint accumulate;  // 1: out[r] += ... (Gemma's norms of a sublayer's output, added to the residual stream)
  float eps;
};

// One threadgroup per output row: out[r] (+)= x[src] / rms(x[src]) * weight.
[[kernel]] void rms_norm(
    device const float* x [[buffer(0)]],     // [rows of x, dim]
    device const float* weight [[buffer(1)]],  // [dim]
    device const uint* rows [[buffer(2)]],     // [R] when gathering
    device float* out [[buffer(3)]],           // [R, dim]
    constant NormParams& p [[buffer(4)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float partial[kRowSimds];
  const uint src = p.gather != 0 ? rows[row] : row;
  device const float* xr = x + src * p.dim;
  float squares = 0.0f;
  for (uint i = tid; i < p.dim; i += kRowThreads) {
    const float v = xr[i];
    squares += v * v;
  }
  squares = simd_sum(squares);
  if (lane == 0) {
    partial[sg] = squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < kRowSimds; ++s) {
    total += partial[s];
  }
  const float inv = rsqrt(total / float(p.dim) + p.eps);
  device float* o = out + row * p.dim;
  for (uint i = tid; i < p.dim; i += kRowThreads) {
    const float v = xr[i] * inv * weight[i];
    o[i] = p.accumulate != 0 ? o[i] + v : v;
  }
}

// ---------------------------------------------------------------------------
// Linear layers

// What the matmul does with each dot product; mode 0 stores y = x W^T (+ b).
static constant constexpr const uint kModeAccumulate = 1;  // y += x W^T (+ b): the residual add
// The gated modes read W = [G; U] and store act(g) * u for g = x G^T, u = x U^T:
static constant constexpr const uint kModeSwiglu = 2;  // silu(g) * u
static constant constexpr const uint kModeGeglu = 3;   // gelu_tanh(g) * u (Gemma)
// gpt-oss: (clamp(u, -limit, limit) + 1) * g' * sigmoid(1.702 g'), g' = min(g, limit)
static constant constexpr const uint kModeClampedSwiglu = 4;

// The gated modes' product of g and u.
inline float gated(uint mode, float g, float u, float limit) {
  if (mode == kModeGeglu) {
    // gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)).
    const float inner = 1.5957691216057308f * (g + 0.044715f * g * g * g);
    return g / (1.0f + exp(-inner)) * u;
  }
  if (mode == kModeClampedSwiglu) {
    const float gc = min(g, limit);
    return (clamp(u, -limit, limit) + 1.0f) * (gc / (1.0f + exp(-1.702f * gc)));
  }
  return g / (1.0f + exp(-g)) * u;
}

struct MatmulParams {
  uint tokens;
  uint in_features;   // K
  uint out_features;  // N (W has 2N rows under kModeSwiglu)
  uint mode;
  uint has_bias;
  uint y_stride;  // elements per row of y (N, or more when y holds several outputs side by side)
  uint y_offset;  // this output's first column in y
  float limit;    // kModeClampedSwiglu's clamp
};

// Weights in GGML's block formats, read by 32-weight chunks: a chunk is a
// Q8_0 or Q4_0 block, or an eighth of a Q4_K or Q6_K super-block. Each
// `chunk` widens one chunk into w (the CPU's kernels::cpu::{quant, kquant}
// dequantize the same way).
struct BlockQ8_0 {
  half d;
  char qs[32];
};
struct BlockQ4_0 {
  half d;
  uchar qs[16];
};
struct BlockQ4K {
  half d;
  half dmin;
  uchar scales[12];
  uchar qs[128];
};
struct BlockQ6K {
  uchar ql[128];
  uchar qh[64];
  char scales[16];
  half d;
};
// MXFP4 (gpt-oss's experts): 32 E2M1 codes sharing an E8M0 exponent.
struct BlockMxfp4 {
  uchar e;
  uchar qs[16];
};
// GGML's kvalues_mxfp4: each E2M1 code's value, doubled.
static constant constexpr const float kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

template <typename T>
struct Chunks;

template <>
struct Chunks<float> {
  static uint per_block() { return 1; }
  static bool dense() { return true; }
  static float element(device const float* b, uint i) { return float(b[i]); }
  static void chunk(device const float* b, uint, thread float* w) {
    for (uint i = 0; i < 32; ++i) w[i] = b[i];
  }
};
template <>
struct Chunks<half> {
  static uint per_block() { return 1; }
  static bool dense() { return true; }
  static float element(device const half* b, uint i) { return float(b[i]); }
  static void chunk(device const half* b, uint, thread float* w) {
    for (uint i = 0; i < 32; ++i) w[i] = float(b[i]);
  }
};
#if defined(__HAVE_BFLOAT__)
template <>
struct Chunks<bfloat> {
  static uint per_block() { return 1; }
  static bool dense() { return true; }
  static float element(device const bfloat* b, uint i) { return float(b[i]); }
  static void chunk(device const bfloat* b, uint, thread float* w) {
    for (uint i = 0; i < 32; ++i) w[i] = float(b[i]);
  }
};
#endif
template <>
struct Chunks<BlockQ8_0> {
  static uint per_block() { return 1; }
  static bool dense() { return false; }
  static float element(device const BlockQ8_0*, uint) { return 0.0f; }  // blocks have no tail
  static void chunk(device const BlockQ8_0* b, uint, thread float* w) {
    const float d = float(b->d);
    for (uint i = 0; i < 32; ++i) w[i] = d * float(b->qs[i]);
  }
};
template <>
struct Chunks<BlockQ4_0> {
  static uint per_block() { return 1; }
  static bool dense() { return false; }
  static float element(device const BlockQ4_0*, uint) { return 0.0f; }  // blocks have no tail
  static void chunk(device const BlockQ4_0* b, uint, thread float* w) {
    const float d = float(b->d);
    for (uint i = 0; i < 16; ++i) {
      w[i] = d * float(int(b->qs[i] & 15) - 8);
      w[i + 16] = d * float(int(b->qs[i] >> 4) - 8);
    }
  }
};
template <>
struct Chunks<BlockQ4K> {
  static uint per_block() { return 8; }
  static bool dense() { return false; }
  static float element(device const BlockQ4K*, uint) { return 0.0f; }  // blocks have no tail
  static void chunk(device const BlockQ4K* b, uint j, thread float* w) {
    // GGML's get_scale_min_k4: 6-bit scale and min of sub-block j.
    device const uchar* q = b->scales;
    uint sc;
    uint m;
    if (j < 4) {
      sc = q[j] & 63;
      m = q[j + 4] & 63;
    } else {
      sc = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4);
      m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    const float d = float(b->d) * float(sc);
    const float dmin = float(b->dmin) * float(m);
    device const uchar* codes = b->qs + 32 * (j / 2);
    const uint shift = (j % 2) * 4;
    for (uint i = 0; i < 32; ++i) w[i] = d * float((codes[i] >> shift) & 15) - dmin;
  }
};
template <>
struct Chunks<BlockQ6K> {
  static uint per_block() { return 8; }
  static bool dense() { return false; }
  static float element(device const BlockQ6K*, uint) { return 0.0f; }  // blocks have no tail
  static void chunk(device const BlockQ6K* b, uint c, thread float* w) {
    // GGML's dequantize_row_q6_K: half n of the block, quarter q of it.
    const uint n = c / 4;
    const uint q = c % 4;
    device const uchar* ql = b->ql + 64 * n + (q % 2) * 32;
    device const uchar* qh = b->qh + 32 * n;
    const uint low_shift = (q / 2) * 4;
    const float d = float(b->d);
    for (uint i = 0; i < 32; ++i) {
      const int code = int(((ql[i] >> low_shift) & 15) | (((qh[i] >> (2 * q)) & 3) << 4)) - 32;
      w[i] = d * float(b->scales[8 * n + i / 16 + 2 * q]) * float(code);
    }
  }
};

// One SIMD group's share of a matmul: output rows n0 .. n0 +
// kMatmulRowsPerSimd (of `out_features`) for `nt` input rows, row t read
// from x at element x_at[t] and written to y at element y_at[t] (plus n).
// Its lanes walk the weight rows together (coalesced); each x element is
// loaded once per SIMD group and multiplied into every row's sums, each
// weight element widened once and multiplied into up to kMatmulTokens
// rows' sums, and one simd_sum per (row, token) finishes them. `w` and
// `bias` start at this matrix (an expert's, under matmul_id).
template <typename W>
inline void matmul_simd_rows(
    device const float* x,
    thread const uint* x_at,
    uint nt,
    device const W* w,
    device const float* bias,
    device float* y,
    thread const uint* y_at,
    uint n0,
    uint k,
    uint out_features,
    uint mode,
    bool has_bias,
    float limit,
    uint lane) {
  const uint rows = min(kMatmulRowsPerSimd, out_features - n0);
  const bool glu = mode >= kModeSwiglu;
  // A row holds k elements of a float type (read 32 at a time, then a
  // tail), or k / 32 / per_block blocks (k a multiple of the block).
  const bool dense = Chunks<W>::dense();
  const uint per_block = Chunks<W>::per_block();
  const uint chunks = k / 32;
  const uint row_blocks = dense ? k : chunks / per_block;
  float acc[kMatmulRowsPerSimd][kMatmulTokens];
  float up[kMatmulRowsPerSimd][kMatmulTokens];
  for (uint r = 0; r < kMatmulRowsPerSimd; ++r) {
    for (uint t = 0; t < kMatmulTokens; ++t) {
      acc[r][t] = 0.0f;
      up[r][t] = 0.0f;
    }
  }
  // Lane c takes chunks c, c + 32, ...: 32 consecutive weights of each row.
  for (uint c = lane; c < chunks; c += kModelSimdWidth) {
    // The block holding chunk c, in W's units from a row's start.
    const uint at = dense ? c * 32 : c / per_block;
    const uint part = c % per_block;
    for (uint r = 0; r < rows; ++r) {
      float wv[32];
      Chunks<W>::chunk(w + (n0 + r) * row_blocks + at, part, wv);
      float uv[32];
      if (glu) {
        Chunks<W>::chunk(w + (n0 + r + out_features) * row_blocks + at, part, uv);
      }
      for (uint t = 0; t < nt; ++t) {
        device const float* xc = x + x_at[t] + c * 32;
        float dot = 0.0f;
        float up_dot = 0.0f;
        for (uint i = 0; i < 32; ++i) {
          dot += wv[i] * xc[i];
          if (glu) {
            up_dot += uv[i] * xc[i];
          }
        }
        acc[r][t] += dot;
        up[r][t] += up_dot;
      }
    }
  }
  // The tail of a float row past its last whole chunk, an element a lane.
  for (uint i = chunks * 32 + lane; dense && i < k; i += kModelSimdWidth) {
    for (uint r = 0; r < rows; ++r) {
      const float wv = Chunks<W>::element(w + (n0 + r) * k, i);
      const float uv = glu ? Chunks<W>::element(w + (n0 + r + out_features) * k, i) : 0.0f;
      for (uint t = 0; t < nt; ++t) {
        acc[r][t] += wv * x[x_at[t] + i];
        up[r][t] += uv * x[x_at[t] + i];
      }
    }
  }
  for (uint r = 0; r < rows; ++r) {
    const uint n = n0 + r;
    for (uint t = 0; t < nt; ++t) {
      float dot = simd_sum(acc[r][t]);
      const float up_dot = glu ? simd_sum(up[r][t]) : 0.0f;
      if (lane != 0) {
        continue;
      }
      device float* out = y + y_at[t] + n;
      if (has_bias) {
        dot += bias[n];
      }
      if (mode == kModeAccumulate) {
        *out += dot;
      } else if (glu) {
        const float u = has_bias ? up_dot + bias[n + out_features] : up_dot;
        *out = gated(mode, dot, u, limit);
      } else {
        *out = dot;
      }
    }
  }
}

template <>
struct Chunks<BlockMxfp4> {
  static uint per_block() { return 1; }
  static bool dense() { return false; }
  static float element(device const BlockMxfp4*, uint) { return 0.0f; }  // blocks have no tail
  static void chunk(device const BlockMxfp4* b, uint, thread float* w) {
    // The doubled values times half the scale, GGML_E8M0_TO_FP32_HALF:
    // 2^(e - 128), subnormal for e < 2.
    const uint e = b->e;
    const float d = as_type<float>(e < 2 ? 0x00200000u << e : (e - 1) << 23);
    for (uint i = 0; i < 16; ++i) {
      w[i] = d * kMxfp4Values[b->qs[i] & 15];
      w[i + 16] = d * kMxfp4Values[b->qs[i] >> 4];
    }
  }
};

// Grid: (ceil(N / (kMatmulSimds * kMatmulRowsPerSimd)), ceil(T /
// kMatmulTokens)); each SIMD group computes kMatmulRowsPerSimd output rows
// for a tile of kMatmulTokens tokens (matmul_simd_rows). At decode (T = 1)
// every weight byte is read once per step.
template <typename W>
[[kernel]] void matmul(
    device const float* x [[buffer(0)]],     // [T, K]
    device const W* w [[buffer(1)]],         // [N, K] (or [2N, K]) in elements or blocks
    device const float* bias [[buffer(2)]],  // [N] (or [2N]) when has_bias
    device float* y [[buffer(3)]],           // [T, y_stride]
    constant MatmulParams& p [[buffer(4)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const uint n0 = (group.x * kMatmulSimds + sg) * kMatmulRowsPerSimd;
  if (n0 >= p.out_features) {
    return;  // the whole SIMD group: no collective is left waiting
  }
  const uint t0 = group.y * kMatmulTokens;
  const uint nt = min(kMatmulTokens, p.tokens - t0);
  uint x_at[kMatmulTokens];
  uint y_at[kMatmulTokens];
  for (uint t = 0; t < nt; ++t) {
    x_at[t] = (t0 + t) * p.in_features;
    y_at[t] = (t0 + t) * p.y_stride + p.y_offset;
  }
  matmul_simd_rows<W>(
      x, x_at, nt, w, bias, y, y_at, n0, p.in_features, p.out_features, p.mode, p.has_bias != 0, p.limit, lane);
}

// ---------------------------------------------------------------------------
// Mixtures of experts (llama.cpp's mul_mat_id): route each token to its
// experts (moe_route), group the (token, expert) pairs by expert into tiles
// of at most kMatmulTokens pairs (moe_group), run every tile's projection
// against its expert's weights only (matmul_id: a GEMV per pair at decode,
// a GEMM over a tile's pairs at prefill), and add each token's weighted
// expert outputs into the residual stream (moe_combine).

// Most experts a router may score (threadgroup arrays are sized by it).
static constant constexpr const uint kMaxExperts = 512;
// Well below every finite score, and finite itself (fast math).
static constant constexpr const float kNoScore = -3.0e38f;

struct RouteParams {
  uint experts;
  uint top_k;
  uint sigmoid;         // 0: softmax scores; 1: sigmoid scores (DeepSeek-V3, GLM-4.5)
  uint has_correction;  // 1: the choice adds correction[e] to the scores (not the weights)
  uint norm_topk;       // 1: the kept weights are renormalised to sum to 1
  uint groups;          // experts fall in `groups` equal groups ...
  uint groups_kept;     // ... and a token chooses from its best `groups_kept`
  float scale;          // the kept weights' scale (routed_scaling_factor)
};

// Grid: (T); one SIMD group a token. Scores every expert, keeps the top_k
// best (the lower expert on a tie), best first, and their weights: the
// unbiased scores, renormalised and scaled as the model says. A group's
// rank is the sum of its two best choice scores; experts outside the kept
// groups get a choice of 0 (transformers' masked_fill).
[[kernel]] void moe_route(
    device const float* logits [[buffer(0)]],      // [T, experts]
    device const float* correction [[buffer(1)]],  // [experts] when has_correction
    device uint* ids [[buffer(2)]],                // [T, top_k]
    device float* weights [[buffer(3)]],           // [T, top_k]
    constant RouteParams& p [[buffer(4)]],
    uint token [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float scores[kMaxExperts];
  threadgroup float choice[kMaxExperts];
  threadgroup float group_score[kMaxExperts];
  const uint n = p.experts;
  device const float* l = logits + token * n;
  if (p.sigmoid == 0) {
    float m = kNoScore;
    for (uint e = lane; e < n; e += kModelSimdWidth) {
      m = max(m, l[e]);
    }
    m = simd_max(m);
    float sum = 0.0f;
    for (uint e = lane; e < n; e += kModelSimdWidth) {
      const float v = exp(l[e] - m);
      scores[e] = v;
      sum += v;
    }
    sum = simd_sum(sum);
    for (uint e = lane; e < n; e += kModelSimdWidth) {
      scores[e] = scores[e] / sum;
    }
  } else {
    for (uint e = lane; e < n; e += kModelSimdWidth) {
      scores[e] = 1.0f / (1.0f + exp(-l[e]));
    }
  }
  for (uint e = lane; e < n; e += kModelSimdWidth) {
    choice[e] = p.has_correction != 0 ? scores[e] + correction[e] : scores[e];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lane != 0) {
    return;
  }
  if (p.groups > 1 && p.groups_kept < p.groups) {
    const uint size = n / p.groups;
    for (uint g = 0; g < p.groups; ++g) {
      float best = kNoScore;
      float second = kNoScore;
      for (uint e = g * size; e < (g + 1) * size; ++e) {
        if (choice[e] > best) {
          second = best;
          best = choice[e];
        } else if (choice[e] > second) {
          second = choice[e];
        }
      }
      group_score[g] = size > 1 ? best + second : best;
    }
    for (uint g = 0; g < p.groups; ++g) {
      uint rank = 0;
      for (uint h = 0; h < p.groups; ++h) {
        if (group_score[h] > group_score[g] || (group_score[h] == group_score[g] && h < g)) {
          ++rank;
        }
      }
      if (rank >= p.groups_kept) {
        for (uint e = g * size; e < (g + 1) * size; ++e) {
          choice[e] = 0.0f;
        }
      }
    }
  }
  device uint* out_ids = ids + token * p.top_k;
  device float* out_w = weights + token * p.top_k;
  float total = 0.0f;
  for (uint j = 0; j < p.top_k; ++j) {
    // The best expert not taken yet (taken ones hold kNoScore).
    uint best = 0;
    for (uint e = 1; e < n; ++e) {
      if (choice[e] > choice[best]) {
        best = e;
      }
    }
    choice[best] = kNoScore;  // taken
    out_ids[j] = best;
    total += scores[best];
  }
  for (uint j = 0; j < p.top_k; ++j) {
    const float s = scores[out_ids[j]];
    out_w[j] = (p.norm_topk != 0 ? s / total : s) * p.scale;
  }
}

struct GroupParams {
  uint pairs;      // T * top_k
  uint experts;
  uint max_tiles;  // ceil(pairs / kMatmulTokens) + min(experts, pairs)
};

// Grid: (1), kRowThreads threads. Groups the pairs (token t's j-th expert
// is pair t * top_k + j) by expert, each expert's in pair order, and cuts
// every expert's run into tiles of at most kMatmulTokens pairs:
// tiles[g] = (expert, first index into order, pairs); unused tiles hold 0
// pairs. Thread e counts and places expert e's pairs.
[[kernel]] void moe_group(
    device const uint* ids [[buffer(0)]],  // [pairs]
    device uint* order [[buffer(1)]],      // [pairs]: pair indices by expert
    device uint* tiles [[buffer(2)]],      // [max_tiles, 3]
    constant GroupParams& p [[buffer(3)]],
    uint tid [[thread_position_in_threadgroup]]) {
  threadgroup uint counts[kMaxExperts];
  threadgroup uint starts[kMaxExperts];
  threadgroup uint first_tile[kMaxExperts];
  threadgroup uint used_tiles[1];
  for (uint e = tid; e < p.experts; e += kRowThreads) {
    uint c = 0;
    for (uint i = 0; i < p.pairs; ++i) {
      c += ids[i] == e ? 1 : 0;
    }
    counts[e] = c;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    uint start = 0;
    uint tile = 0;
    for (uint e = 0; e < p.experts; ++e) {
      starts[e] = start;
      first_tile[e] = tile;
      start += counts[e];
      tile += (counts[e] + kMatmulTokens - 1) / kMatmulTokens;
    }
    used_tiles[0] = tile;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint e = tid; e < p.experts; e += kRowThreads) {
    uint placed = 0;
    for (uint i = 0; i < p.pairs; ++i) {
      if (ids[i] == e) {
        order[starts[e] + placed] = i;
        ++placed;
      }
    }
    for (uint j = 0; j * kMatmulTokens < counts[e]; ++j) {
      device uint* tile = tiles + 3 * (first_tile[e] + j);
      tile[0] = e;
      tile[1] = starts[e] + j * kMatmulTokens;
      tile[2] = min(kMatmulTokens, counts[e] - j * kMatmulTokens);
    }
  }
  for (uint g = used_tiles[0] + tid; g < p.max_tiles; g += kRowThreads) {
    tiles[3 * g] = 0;
    tiles[3 * g + 1] = 0;
    tiles[3 * g + 2] = 0;
  }
}

struct MatmulIdParams {
  uint in_features;   // K
  uint out_features;  // N per expert (each expert has 2N rows under kModeSwiglu)
  uint mode;          // a gated mode, or 0 (store)
  uint has_bias;
  uint x_div;  // pair i reads x row i / x_div: top_k for the tokens' rows, 1 for the pairs' own
  float limit;  // kModeClampedSwiglu's clamp
};

// Grid: (ceil(N / (kMatmulSimds * kMatmulRowsPerSimd)), max_tiles). Tile g's
// pairs through their expert's matrix only: y[pair] = x[pair / x_div] W_e^T
// (+ b_e), or SwiGLU's product of the expert's gate and up.
template <typename W>
[[kernel]] void matmul_id(
    device const float* x [[buffer(0)]],     // [rows, K]
    device const W* w [[buffer(1)]],         // [experts, N (or 2N), K] in elements or blocks
    device const float* bias [[buffer(2)]],  // [experts, N (or 2N)] when has_bias
    device float* y [[buffer(3)]],           // [pairs, N]
    device const uint* order [[buffer(4)]],  // [pairs]
    device const uint* tiles [[buffer(5)]],  // [max_tiles, 3]
    constant MatmulIdParams& p [[buffer(6)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  device const uint* tile = tiles + 3 * group.y;
  const uint nt = tile[2];
  const uint n0 = (group.x * kMatmulSimds + sg) * kMatmulRowsPerSimd;
  if (nt == 0 || n0 >= p.out_features) {
    return;  // the whole SIMD group
  }
  const uint expert = tile[0];
  const uint k = p.in_features;
  const uint expert_rows = p.mode >= kModeSwiglu ? 2 * p.out_features : p.out_features;
  const uint row_units = Chunks<W>::dense() ? k : k / 32 / Chunks<W>::per_block();
  uint x_at[kMatmulTokens];
  uint y_at[kMatmulTokens];
  for (uint t = 0; t < nt; ++t) {
    const uint pair = order[tile[1] + t];
    x_at[t] = pair / p.x_div * k;
    y_at[t] = pair * p.out_features;
  }
  matmul_simd_rows<W>(
      x,
      x_at,
      nt,
      w + expert * expert_rows * row_units,
      bias + expert * expert_rows,
      y,
      y_at,
      n0,
      k,
      p.out_features,
      p.mode,
      p.has_bias != 0,
      p.limit,
      lane);
}

struct CombineParams {
  uint hidden;
  uint top_k;
};

// Grid: (T). hidden[t] += sum over j of weights[t, j] * expert_out[t * top_k + j].
[[kernel]] void moe_combine(
    device const float* expert_out [[buffer(0)]],  // [T * top_k, hidden]
    device const float* weights [[buffer(1)]],     // [T, top_k]
    device float* hidden [[buffer(2)]],            // [T, hidden]
    constant CombineParams& p [[buffer(3)]],
    uint token [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]]) {
  device const float* w = weights + token * p.top_k;
  for (uint i = tid; i < p.hidden; i += kRowThreads) {
    float sum = 0.0f;
    for (uint j = 0; j < p.top_k; ++j) {
      sum += w[j] * expert_out[(token * p.top_k + j) * p.hidden + i];
    }
    hidden[token * p.hidden + i] += sum;
  }
}

// ---------------------------------------------------------------------------
// RoPE, head norm and the KV write

struct RopeParams {
  uint heads;
  uint kv_heads;
  uint head_dim;
  uint padded_dim;  // the row length of q_out and the caches: head_dim, or the
                    // attention kernels' smallest head dim above it, zero-padded
  uint rotary_dim;  // the leading dims RoPE turns (head_dim, or less: GLM-4.5's partial rotary)
  uint num_slots;
  uint head_norm;  // 1: RMSNorm each q and k head first (Qwen3)
  float eps;
};

// One q or k head of `d` values from x to dst: normed by `inv * norm`
// under head_norm, its first `rot` dims turned as rotation pairs (j, j +
// rot/2) by the position's cos and sin, the rest as they are, zero past d
// up to pd. Lane j holds pairs j, j + 32, ...
template <typename D>
inline void rotate_head(
    device const float* x,
    device const float* c,
    device const float* s,
    device const float* norm,
    float inv,
    bool head_norm,
    uint d,
    uint pd,
    uint rot,
    device D* dst,
    uint lane) {
  for (uint i = d + lane; i < pd; i += kModelSimdWidth) {
    dst[i] = static_cast<D>(0.0f);
  }
  const uint half_r = rot / 2;
  for (uint j = lane; j < half_r; j += kModelSimdWidth) {
    float a = x[j];
    float b = x[j + half_r];
    if (head_norm) {
      a = a * inv * norm[j];
      b = b * inv * norm[j + half_r];
    }
    dst[j] = static_cast<D>(a * c[j] - b * s[j]);
    dst[j + half_r] = static_cast<D>(b * c[j] + a * s[j]);
  }
  for (uint i = rot + lane; i < d; i += kModelSimdWidth) {
    dst[i] = static_cast<D>(head_norm ? x[i] * inv * norm[i] : x[i]);
  }
}

// Grid: (heads + 2 kv_heads, T); one SIMD group per head of a token's fused
// qkv row `[q heads | k heads | v heads]` (HF's rotate_half layout within
// the rotary dims). A q head goes to `q_out` rotated, a k head to its cache
// slot rotated, a v head to its slot as is. Past head_dim, rows are zero up
// to padded_dim (a zero adds nothing to q.k, and attention's padded output
// columns meet zero columns of o_proj's weight).
template <typename C>
[[kernel]] void rope_qkv_cache(
    device const float* qkv [[buffer(0)]],        // [T, (H + 2 KVH) * D]
    device const float* cos_table [[buffer(1)]],  // [max_positions, rotary_dim/2]
    device const float* sin_table [[buffer(2)]],
    device const uint* positions [[buffer(3)]],   // [T]
    device const uint* slots [[buffer(4)]],       // [T]
    device const float* q_norm [[buffer(5)]],     // [D] under head_norm
    device const float* k_norm [[buffer(6)]],     // [D] under head_norm
    device float* q_out [[buffer(7)]],            // [T, H, padded_dim]
    device C* k_cache [[buffer(8)]],              // [num_slots, KVH, padded_dim]
    device C* v_cache [[buffer(9)]],
    constant RopeParams& p [[buffer(10)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint head = group.x;
  const uint token = group.y;
  const uint d = p.head_dim;
  const uint pd = p.padded_dim;
  const uint row_len = (p.heads + 2 * p.kv_heads) * d;
  device const float* x = qkv + token * row_len + head * d;
  const uint slot = slots[token];
  const bool is_q = head < p.heads;
  const bool is_v = head >= p.heads + p.kv_heads;
  if (is_v) {
    if (slot >= p.num_slots) {
      return;
    }
    device C* dst = v_cache + (slot * p.kv_heads + (head - p.heads - p.kv_heads)) * pd;
    for (uint i = lane; i < pd; i += kModelSimdWidth) {
      dst[i] = static_cast<C>(i < d ? x[i] : 0.0f);
    }
    return;
  }
  float inv = 1.0f;
  if (p.head_norm != 0) {
    float squares = 0.0f;
    for (uint i = lane; i < d; i += kModelSimdWidth) {
      squares += x[i] * x[i];
    }
    inv = rsqrt(simd_sum(squares) / float(d) + p.eps);
  }
  device const float* norm = is_q ? q_norm : k_norm;
  const uint half_r = p.rotary_dim / 2;
  device const float* c = cos_table + positions[token] * half_r;
  device const float* s = sin_table + positions[token] * half_r;
  const bool head_norm = p.head_norm != 0;
  if (is_q) {
    device float* dst = q_out + (token * p.heads + head) * pd;
    rotate_head<float>(x, c, s, norm, inv, head_norm, d, pd, p.rotary_dim, dst, lane);
    return;
  }
  if (slot >= p.num_slots) {
    return;
  }
  device C* dst = k_cache + (slot * p.kv_heads + (head - p.heads)) * pd;
  rotate_head<C>(x, c, s, norm, inv, head_norm, d, pd, p.rotary_dim, dst, lane);
}

// ---------------------------------------------------------------------------
// Instantiations

#define INSTANTIATE_WEIGHT_KERNELS(W, NAME)                                          \
  template TINYVLLM_KERNEL("embed_rows_" #NAME) decltype(embed_rows<W>) embed_rows<W>; \
  template TINYVLLM_KERNEL("matmul_" #NAME) decltype(matmul<W>) matmul<W>;

INSTANTIATE_WEIGHT_KERNELS(float, f32)
INSTANTIATE_WEIGHT_KERNELS(half, f16)
#if defined(__HAVE_BFLOAT__)
INSTANTIATE_WEIGHT_KERNELS(bfloat, bf16)
#endif
template TINYVLLM_KERNEL("matmul_q8_0") decltype(matmul<BlockQ8_0>) matmul<BlockQ8_0>;
template TINYVLLM_KERNEL("matmul_q4_0") decltype(matmul<BlockQ4_0>) matmul<BlockQ4_0>;
template TINYVLLM_KERNEL("matmul_q4_k") decltype(matmul<BlockQ4K>) matmul<BlockQ4K>;
template TINYVLLM_KERNEL("matmul_q6_k") decltype(matmul<BlockQ6K>) matmul<BlockQ6K>;
template TINYVLLM_KERNEL("matmul_mxfp4") decltype(matmul<BlockMxfp4>) matmul<BlockMxfp4>;

#define INSTANTIATE_MATMUL_ID(W, NAME) \
  template TINYVLLM_KERNEL("matmul_id_" #NAME) decltype(matmul_id<W>) matmul_id<W>;
INSTANTIATE_MATMUL_ID(float, f32)
INSTANTIATE_MATMUL_ID(half, f16)
#if defined(__HAVE_BFLOAT__)
INSTANTIATE_MATMUL_ID(bfloat, bf16)
#endif
INSTANTIATE_MATMUL_ID(BlockQ8_0, q8_0)
INSTANTIATE_MATMUL_ID(BlockQ4_0, q4_0)
INSTANTIATE_MATMUL_ID(BlockQ4K, q4_k)
INSTANTIATE_MATMUL_ID(BlockQ6K, q6_k)
INSTANTIATE_MATMUL_ID(BlockMxfp4, mxfp4)

template TINYVLLM_KERNEL("rope_qkv_cache_f32") decltype(rope_qkv_cache<float>) rope_qkv_cache<float>;
template TINYVLLM_KERNEL("rope_qkv_cache_f16") decltype(rope_qkv_cache<half>) rope_qkv_cache<half>;
