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
// The host side is kernels/src/metal/step.rs.

#include <metal_stdlib>
using namespace metal;

// Explicit instantiations name their host function with Metal attributes,
// which clang cannot parse in that position; the Linux syntax check's shim
// (shim/metal_shim.h) defines this macro empty.
#ifndef TINYVLLM_KERNEL
#define TINYVLLM_KERNEL(name) [[host_name(name)]] [[kernel]]
#endif

static constant constexpr const uint kModelSimdWidth = 32;
// Threads per threadgroup of the row kernels (embed, rms_norm, argmax).
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
  uint out_features;  // N (the width of y; W has 2N rows under kModeSwiglu)
  uint mode;
  uint has_bias;
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
    device const W* w [[buffer(1)]],         // [N, K] (or [2N, K])
    device const float* bias [[buffer(2)]],  // [N] (or [2N]) when has_bias
    device float* y [[buffer(3)]],           // [T, N]
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
  device const float* xs = x + t0 * k;
  float acc[kMatmulRowsPerSimd][kMatmulTokens];
  float up[kMatmulRowsPerSimd][kMatmulTokens];
  for (uint r = 0; r < kMatmulRowsPerSimd; ++r) {
    for (uint t = 0; t < kMatmulTokens; ++t) {
      acc[r][t] = 0.0f;
      up[r][t] = 0.0f;
    }
  }
  for (uint i = lane; i < k; i += kModelSimdWidth) {
    float xv[kMatmulTokens];
    for (uint t = 0; t < nt; ++t) {
      xv[t] = xs[t * k + i];
    }
    for (uint r = 0; r < rows; ++r) {
      const float wv = float(w[(n0 + r) * k + i]);
      for (uint t = 0; t < nt; ++t) {
        acc[r][t] += wv * xv[t];
      }
      if (glu) {
        const float uv = float(w[(n0 + r + p.out_features) * k + i]);
        for (uint t = 0; t < nt; ++t) {
          up[r][t] += uv * xv[t];
        }
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
      device float* out = y + (t0 + t) * p.out_features + n;
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
// Greedy sampling

// One threadgroup per row: the index of the row's largest logit, the lowest
// index among equals (as the host sampler's argmax).
[[kernel]] void argmax_rows(
    device const float* logits [[buffer(0)]],  // [R, vocab]
    device uint* out [[buffer(1)]],            // [R]
    constant uint& vocab [[buffer(2)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float best_values[kRowSimds];
  threadgroup uint best_indices[kRowSimds];
  device const float* l = logits + row * vocab;
  float best = -3.402823466e38f;  // finite: the library is built with fast math
  uint best_index = 0xffffffffu;
  for (uint i = tid; i < vocab; i += kRowThreads) {
    const float v = l[i];
    if (v > best || (v == best && i < best_index)) {
      best = v;
      best_index = i;
    }
  }
  const float simd_best = simd_max(best);
  const uint simd_index = simd_min(best == simd_best ? best_index : 0xffffffffu);
  if (lane == 0) {
    best_values[sg] = simd_best;
    best_indices[sg] = simd_index;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float v = best_values[0];
    uint index = best_indices[0];
    for (uint s = 1; s < kRowSimds; ++s) {
      if (best_values[s] > v || (best_values[s] == v && best_indices[s] < index)) {
        v = best_values[s];
        index = best_indices[s];
      }
    }
    out[row] = index == 0xffffffffu ? 0 : index;
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

template TINYVLLM_KERNEL("rope_qkv_cache_f32") decltype(rope_qkv_cache<float>) rope_qkv_cache<float>;
template TINYVLLM_KERNEL("rope_qkv_cache_f16") decltype(rope_qkv_cache<half>) rope_qkv_cache<half>;
