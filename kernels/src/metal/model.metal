// The dense model step on Metal, besides attention and its KV write: the
// token embedding, RMSNorm, the linear layers (GEMV for decode, a GEMM over
// tiles of 8 tokens for prefill) with their epilogues fused in, and RoPE
// fused with Qwen3's head norm and the KV cache write. Activations are f32
// throughout; weights are f32, f16 or bf16 and widened in registers.
//
// What is fused, and why (each saves a dispatch and a round trip of the
// activations through device memory, as llama.cpp's Metal graph does):
// - the residual add goes into the epilogue of o_proj and down_proj, which
//   add their output to the residual stream in place (`kModeAccumulate`);
// - SwiGLU's product is the epilogue of the stacked gate/up projection,
//   which reads row n of gate and of up together (`kModeSwiglu`);
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
};

// One threadgroup per token: out[t] = table[ids[t]], widened to f32.
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
    dst[i] = float(src[i]);
  }
}

// ---------------------------------------------------------------------------
// RMSNorm

struct NormParams {
  uint dim;
  uint gather;  // 1: row r of the output normalises row rows[r] of x
  float eps;
};

// One threadgroup per output row: out[r] = x[src] / rms(x[src]) * weight.
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
    o[i] = xr[i] * inv * weight[i];
  }
}

// ---------------------------------------------------------------------------
// Linear layers

// What the matmul does with each dot product; mode 0 stores y = x W^T (+ b).
static constant constexpr const uint kModeAccumulate = 1;  // y += x W^T (+ b): the residual add
static constant constexpr const uint kModeSwiglu = 2;      // y = silu(x G^T) * (x U^T), W = [G; U]

struct MatmulParams {
  uint tokens;
  uint in_features;   // K
  uint out_features;  // N (W has 2N rows under kModeSwiglu)
  uint mode;
  uint has_bias;
  uint y_stride;  // elements per row of y (N, or more when y holds several outputs side by side)
  uint y_offset;  // this output's first column in y
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

// Grid: (ceil(N / (kMatmulSimds * kMatmulRowsPerSimd)), ceil(T /
// kMatmulTokens)); each SIMD group computes kMatmulRowsPerSimd output rows.
// Its lanes walk the weight rows together (coalesced); each x element is
// loaded once per SIMD group and multiplied into every row's sums, each
// weight element widened once and multiplied into up to kMatmulTokens
// tokens' sums, and one simd_sum per (row, token) finishes them. At decode
// (T = 1) every weight byte is read once per step.
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
  const uint rows = min(kMatmulRowsPerSimd, p.out_features - n0);
  const uint t0 = group.y * kMatmulTokens;
  const uint nt = min(kMatmulTokens, p.tokens - t0);
  const bool glu = p.mode == kModeSwiglu;
  const uint k = p.in_features;
  // A row holds k elements of a float type (read 32 at a time, then a
  // tail), or k / 32 / per_block blocks (k a multiple of the block).
  const bool dense = Chunks<W>::dense();
  const uint per_block = Chunks<W>::per_block();
  const uint chunks = k / 32;
  const uint row_blocks = dense ? k : chunks / per_block;
  device const float* xs = x + t0 * k;
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
        Chunks<W>::chunk(w + (n0 + r + p.out_features) * row_blocks + at, part, uv);
      }
      for (uint t = 0; t < nt; ++t) {
        device const float* xc = xs + t * k + c * 32;
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
      const float uv = glu ? Chunks<W>::element(w + (n0 + r + p.out_features) * k, i) : 0.0f;
      for (uint t = 0; t < nt; ++t) {
        acc[r][t] += wv * xs[t * k + i];
        up[r][t] += uv * xs[t * k + i];
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
      device float* out = y + (t0 + t) * p.y_stride + p.y_offset + n;
      if (p.has_bias != 0) {
        dot += bias[n];
      }
      if (p.mode == kModeAccumulate) {
        *out += dot;
      } else if (glu) {
        const float u = p.has_bias != 0 ? up_dot + bias[n + p.out_features] : up_dot;
        *out = dot / (1.0f + exp(-dot)) * u;
      } else {
        *out = dot;
      }
    }
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
  uint num_slots;
  uint head_norm;  // 1: RMSNorm each q and k head first (Qwen3)
  float eps;
};

// Grid: (heads + 2 kv_heads, T); one SIMD group per head of a token's fused
// qkv row `[q heads | k heads | v heads]`. Lane j holds the rotation pairs
// (j, j + D/2), (j + 32, j + 32 + D/2), ... (HF's rotate_half layout). A q
// head goes to `q_out` rotated, a k head to its cache slot rotated, a v head
// to its slot as is. Past head_dim, rows are zero up to padded_dim (a zero
// adds nothing to q.k, and attention's padded output columns meet zero
// columns of o_proj's weight).
template <typename C>
[[kernel]] void rope_qkv_cache(
    device const float* qkv [[buffer(0)]],        // [T, (H + 2 KVH) * D]
    device const float* cos_table [[buffer(1)]],  // [max_positions, D/2]
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
  const uint half_d = d / 2;
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
    for (uint j = lane; j < half_d; j += kModelSimdWidth) {
      squares += x[j] * x[j] + x[j + half_d] * x[j + half_d];
    }
    inv = rsqrt(simd_sum(squares) / float(d) + p.eps);
  }
  device const float* norm = is_q ? q_norm : k_norm;
  device const float* c = cos_table + positions[token] * half_d;
  device const float* s = sin_table + positions[token] * half_d;
  if (is_q) {
    device float* dst = q_out + (token * p.heads + head) * pd;
    for (uint i = d + lane; i < pd; i += kModelSimdWidth) {
      dst[i] = 0.0f;
    }
    for (uint j = lane; j < half_d; j += kModelSimdWidth) {
      float a = x[j];
      float b = x[j + half_d];
      if (p.head_norm != 0) {
        a = a * inv * norm[j];
        b = b * inv * norm[j + half_d];
      }
      dst[j] = a * c[j] - b * s[j];
      dst[j + half_d] = b * c[j] + a * s[j];
    }
    return;
  }
  if (slot >= p.num_slots) {
    return;
  }
  device C* dst = k_cache + (slot * p.kv_heads + (head - p.heads)) * pd;
  for (uint i = d + lane; i < pd; i += kModelSimdWidth) {
    dst[i] = static_cast<C>(0.0f);
  }
  for (uint j = lane; j < half_d; j += kModelSimdWidth) {
    float a = x[j];
    float b = x[j + half_d];
    if (p.head_norm != 0) {
      a = a * inv * norm[j];
      b = b * inv * norm[j + half_d];
    }
    dst[j] = static_cast<C>(a * c[j] - b * s[j]);
    dst[j + half_d] = static_cast<C>(b * c[j] + a * s[j]);
  }
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

template TINYVLLM_KERNEL("rope_qkv_cache_f32") decltype(rope_qkv_cache<float>) rope_qkv_cache<float>;
template TINYVLLM_KERNEL("rope_qkv_cache_f16") decltype(rope_qkv_cache<half>) rope_qkv_cache<half>;
