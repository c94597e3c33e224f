// Paged attention for decode tokens (q_len = 1) on Metal, in the manner of
// vLLM's paged_attention_v1/v2: K/V are read in place from the paged pools
// (`[num_blocks, block_size, kv_heads, head_dim]`) through each sequence's
// block table, with an online softmax accumulated in float.
//
// Grid: (kv head x slices of its GQA group, decode sequence, partition);
// threadgroup: 4 simdgroups of 32 lanes, serving the query heads of one kv
// head (up to 8) so each K/V row is read once for all of them. A context longer than kPartitionSize keys is split into
// partitions that run in parallel and write an unnormalised partial result
// with its max and sum; `paged_attention_reduce` then merges the partitions.
// A context that fits in one partition is finished in a single pass.
// GQA: query head h reads kv head h / (num_heads / num_kv_heads).
// Attention sinks (gpt-oss): each head's learned logit joins the softmax's
// denominator, where a result is finished (the single pass or the reduce).

#include <metal_stdlib>
using namespace metal;

// Explicit instantiations name their host function with Metal attributes,
// which clang cannot parse in that position; the Linux syntax check's shim
// (shim/metal_shim.h) defines this macro empty.
#ifndef TINYVLLM_KERNEL
#define TINYVLLM_KERNEL(name) [[host_name(name)]] [[kernel]]
#endif

// Keys per partition (the host's PARTITION_SIZE).
static constant constexpr const uint kPartitionSize = 512;
static constant constexpr const uint kSimdWidth = 32;
static constant constexpr const uint kNumSimds = 4;
static constant constexpr const uint kThreads = kSimdWidth * kNumSimds;
// The running max before any key is seen. Finite on purpose: the library is
// built with fast math, which may assume there are no infinities.
static constant constexpr const float kNoScore = -1e30f;

struct DecodeParams {
  uint num_heads;
  uint num_kv_heads;
  uint block_size;
  uint max_blocks;      // row length of the flattened block tables
  uint sliding_window;  // 0: none; else a query at p sees keys > p - window
  uint max_partitions;  // 0: single pass into `out`; else the scratch row length
  float scale;
  uint has_sinks;  // 1: each head's sink logit joins its softmax
};

// The first key position a query at `pos` sees.
inline uint decode_first_visible(uint pos, uint window) {
  return (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
}

// What finishes a softmax of running max m and sum s: 1 / s, or with a
// sink logit in the denominator, exp(m - top) / (s exp(m - top) +
// exp(sink - top)) where top = max(m, sink).
inline float decode_finish(float m, float s, bool has_sink, float sink) {
  if (!has_sink) {
    return s > 0.0f ? 1.0f / s : 0.0f;
  }
  const float top = max(m, sink);
  const float keep = fast::exp(m - top);
  return keep / (s * keep + fast::exp(sink - top));
}

// Pool slot of the token at `pos` of a sequence.
inline uint decode_slot(device const uint* table, uint pos, uint block_size) {
  return table[pos / block_size] * block_size + pos % block_size;
}

// Max / sum of one value per thread over the threadgroup; every thread gets
// the result. `scratch` holds one float per simdgroup.
inline float decode_reduce_max(float x, threadgroup float* scratch, uint lane, uint sg) {
  x = simd_max(x);
  if (lane == 0) {
    scratch[sg] = x;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float r = scratch[0];
  for (uint s = 1; s < kNumSimds; ++s) {
    r = max(r, scratch[s]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // scratch is reused next
  return r;
}

inline float decode_reduce_sum(float x, threadgroup float* scratch, uint lane, uint sg) {
  x = simd_sum(x);
  if (lane == 0) {
    scratch[sg] = x;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float r = 0.0f;
  for (uint s = 0; s < kNumSimds; ++s) {
    r += scratch[s];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return r;
}

// Query heads one decode threadgroup serves: all heads of a GQA group up to
// this many (the host's `decode_heads_per_group`), so each K and V row is
// read once for them. Bounded so the per-simdgroup accumulators fit 16 KiB
// of threadgroup memory.
template <uint HEAD_DIM>
constexpr uint decode_max_heads() {
  return HEAD_DIM <= 128 ? 8 : 4;
}

// Grid: (kv head x ceil(group / heads per threadgroup), decode sequence,
// partition). A threadgroup serves `heads` query heads of one kv head: every
// K row of its keys is read once and scored against each of them, every V
// row read once and accumulated into each (vLLM's and llama.cpp's GQA
// decode do the same). T: the queries' and output's type; C: the caches'
// (T, or half under float queries: an f16 KV cache widened as it is read).
template <typename T, typename C, uint HEAD_DIM>
[[kernel]] void paged_attention_decode(
    device const T* q [[buffer(0)]],                  // [num_tokens, num_heads, HEAD_DIM]
    device const C* k_cache [[buffer(1)]],            // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    device const C* v_cache [[buffer(2)]],            // same
    device const uint* query_start_loc [[buffer(3)]], // [S + 1]
    device const uint* context_lens [[buffer(4)]],    // [S]
    device const uint* block_tables [[buffer(5)]],    // [S, max_blocks]
    device const uint* decode_seqs [[buffer(6)]],     // [D]: the sequences with q_len = 1
    device T* out [[buffer(7)]],                      // [num_tokens, num_heads, HEAD_DIM]
    device float* part_acc [[buffer(8)]],             // [D, num_heads, max_partitions, HEAD_DIM]
    device float* part_max [[buffer(9)]],             // [D, num_heads, max_partitions]
    device float* part_sum [[buffer(10)]],            // [D, num_heads, max_partitions]
    constant DecodeParams& p [[buffer(11)]],
    device const float* sinks [[buffer(12)]],         // [num_heads] under has_sinks
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint kPerLane = HEAD_DIM / kSimdWidth;
  constexpr uint kMaxHeads = decode_max_heads<HEAD_DIM>();
  // Per-simdgroup softmax state of each head, merged at the end
  // (threadgroup variables live at kernel scope).
  threadgroup float sg_max[kNumSimds * kMaxHeads];
  threadgroup float sg_sum[kNumSimds * kMaxHeads];
  threadgroup float sg_acc[kNumSimds * kMaxHeads * HEAD_DIM];

  const uint group = p.num_heads / p.num_kv_heads;
  const uint slices = (group + kMaxHeads - 1) / kMaxHeads;
  const uint kv_head = tg.x / slices;
  const uint first_head = kv_head * group + (tg.x % slices) * kMaxHeads;
  const uint heads = min(kMaxHeads, kv_head * group + group - first_head);
  const uint seq = decode_seqs[tg.y];
  const uint part = tg.z;
  const uint ctx = context_lens[seq];
  const bool partitioned = p.max_partitions != 0;

  // The keys of this threadgroup: its partition of the visible range.
  uint begin = decode_first_visible(ctx - 1, p.sliding_window);
  uint end = ctx;
  if (partitioned) {
    // The grid fits the longest context; shorter ones have nothing here.
    // The whole threadgroup leaves together, before any barrier.
    if (part * kPartitionSize >= ctx) {
      return;
    }
    begin = max(begin, part * kPartitionSize);
    end = min(end, (part + 1) * kPartitionSize);
  }

  // The queries, pre-scaled. Lane l holds elements l, l + 32, ..., so that
  // a simdgroup reads each K or V row in coalesced runs of 32 elements.
  const uint row = query_start_loc[seq];
  float qv[kMaxHeads][kPerLane];
  float acc[kMaxHeads][kPerLane];
  float run_max[kMaxHeads];
  float run_sum[kMaxHeads];
  for (uint h = 0; h < kMaxHeads; ++h) {
    device const T* q_row = q + (row * p.num_heads + first_head + min(h, heads - 1)) * HEAD_DIM;
    for (uint i = 0; i < kPerLane; ++i) {
      qv[h][i] = h < heads ? float(q_row[lane + i * kSimdWidth]) * p.scale : 0.0f;
      acc[h][i] = 0.0f;
    }
    run_max[h] = kNoScore;
    run_sum[h] = 0.0f;
  }

  device const uint* table = block_tables + seq * p.max_blocks;
  const uint slot_stride = p.num_kv_heads * HEAD_DIM;  // elements per slot
  const uint head_offset = kv_head * HEAD_DIM + lane;

  // Simdgroups take chunks of 32 keys in turn. Lane j looks up the slot of
  // key j of the chunk; the simdgroup then reads the keys one row at a time,
  // scores each against every head, and lane j keeps key j's scores, so the
  // softmax update costs one exp per lane per head per chunk.
  for (uint c0 = begin + sg * kSimdWidth; c0 < end; c0 += kThreads) {
    const uint n = min(kSimdWidth, end - c0);
    const bool has_key = lane < n;
    const uint my_slot = has_key ? decode_slot(table, c0 + lane, p.block_size) : 0;
    float score[kMaxHeads];
    for (uint h = 0; h < kMaxHeads; ++h) {
      score[h] = kNoScore;
    }
    for (uint j = 0; j < n; ++j) {
      device const C* k_row = k_cache + simd_shuffle(my_slot, ushort(j)) * slot_stride + head_offset;
      float k[kPerLane];
      for (uint i = 0; i < kPerLane; ++i) {
        k[i] = float(k_row[i * kSimdWidth]);
      }
      for (uint h = 0; h < heads; ++h) {
        float d = 0.0f;
        for (uint i = 0; i < kPerLane; ++i) {
          d += qv[h][i] * k[i];
        }
        d = simd_sum(d);
        if (lane == j) {
          score[h] = d;
        }
      }
    }
    // Online softmax per head: rescale what was accumulated to the new max.
    float weight[kMaxHeads];
    for (uint h = 0; h < kMaxHeads; ++h) {
      weight[h] = 0.0f;
    }
    for (uint h = 0; h < heads; ++h) {
      const float new_max = max(run_max[h], simd_max(score[h]));
      const float correction = fast::exp(run_max[h] - new_max);
      weight[h] = has_key ? fast::exp(score[h] - new_max) : 0.0f;
      run_sum[h] = run_sum[h] * correction + simd_sum(weight[h]);
      run_max[h] = new_max;
      for (uint i = 0; i < kPerLane; ++i) {
        acc[h][i] *= correction;
      }
    }
    for (uint j = 0; j < n; ++j) {
      device const C* v_row = v_cache + simd_shuffle(my_slot, ushort(j)) * slot_stride + head_offset;
      float v[kPerLane];
      for (uint i = 0; i < kPerLane; ++i) {
        v[i] = float(v_row[i * kSimdWidth]);
      }
      for (uint h = 0; h < heads; ++h) {
        const float w = simd_shuffle(weight[h], ushort(j));
        for (uint i = 0; i < kPerLane; ++i) {
          acc[h][i] += w * v[i];
        }
      }
    }
  }

  // Merge the simdgroups' partial softmaxes; each has its own running max.
  // A simdgroup that saw no key has sum 0 and is left out.
  for (uint h = 0; h < heads; ++h) {
    if (lane == 0) {
      sg_max[h * kNumSimds + sg] = run_max[h];
      sg_sum[h * kNumSimds + sg] = run_sum[h];
    }
    for (uint i = 0; i < kPerLane; ++i) {
      sg_acc[(h * kNumSimds + sg) * HEAD_DIM + lane + i * kSimdWidth] = acc[h][i];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (uint h = 0; h < heads; ++h) {
    const uint head = first_head + h;
    threadgroup const float* maxes = sg_max + h * kNumSimds;
    threadgroup const float* sums = sg_sum + h * kNumSimds;
    float total_max = kNoScore;
    for (uint s = 0; s < kNumSimds; ++s) {
      if (sums[s] > 0.0f) {
        total_max = max(total_max, maxes[s]);
      }
    }
    float rescale[kNumSimds];
    float total_sum = 0.0f;
    for (uint s = 0; s < kNumSimds; ++s) {
      rescale[s] = sums[s] > 0.0f ? fast::exp(maxes[s] - total_max) : 0.0f;
      total_sum += sums[s] * rescale[s];
    }
    threadgroup const float* accs = sg_acc + h * kNumSimds * HEAD_DIM;

    if (!partitioned) {
      const float inv = decode_finish(total_max, total_sum, p.has_sinks != 0, p.has_sinks != 0 ? sinks[head] : 0.0f);
      device T* o = out + (row * p.num_heads + head) * HEAD_DIM;
      for (uint e = tid; e < HEAD_DIM; e += kThreads) {
        float x = 0.0f;
        for (uint s = 0; s < kNumSimds; ++s) {
          x += rescale[s] * accs[s * HEAD_DIM + e];
        }
        o[e] = static_cast<T>(x * inv);
      }
      continue;
    }

    // One partition of several: keep the unnormalised accumulator with its
    // max and sum (an empty partition, before the window, writes sum 0).
    const uint idx = (tg.y * p.num_heads + head) * p.max_partitions + part;
    device float* o = part_acc + idx * HEAD_DIM;
    for (uint e = tid; e < HEAD_DIM; e += kThreads) {
      float x = 0.0f;
      for (uint s = 0; s < kNumSimds; ++s) {
        x += rescale[s] * accs[s * HEAD_DIM + e];
      }
      o[e] = x;
    }
    if (tid == 0) {
      part_max[idx] = total_max;
      part_sum[idx] = total_sum;
    }
  }
}

// Merges the partitions of one (query head, decode sequence): every
// partition's sum and accumulator are rescaled to the global max, as in the
// online softmax. Grid: (query head, decode sequence); 128 threads.
template <typename T, uint HEAD_DIM>
[[kernel]] void paged_attention_reduce(
    device const float* part_acc [[buffer(0)]],       // [D, num_heads, max_partitions, HEAD_DIM]
    device const float* part_max [[buffer(1)]],       // [D, num_heads, max_partitions]
    device const float* part_sum [[buffer(2)]],       // [D, num_heads, max_partitions]
    device const uint* query_start_loc [[buffer(3)]], // [S + 1]
    device const uint* context_lens [[buffer(4)]],    // [S]
    device const uint* decode_seqs [[buffer(5)]],     // [D]
    device T* out [[buffer(6)]],                      // [num_tokens, num_heads, HEAD_DIM]
    constant DecodeParams& p [[buffer(7)]],
    device const float* sinks [[buffer(8)]],          // [num_heads] under has_sinks
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  const uint head = tg.x;
  const uint seq = decode_seqs[tg.y];
  // Partitions this sequence wrote; the decode kernel fills all of them.
  const uint num_parts = (context_lens[seq] + kPartitionSize - 1) / kPartitionSize;
  const uint base = (tg.y * p.num_heads + head) * p.max_partitions;
  device const float* maxes = part_max + base;
  device const float* sums = part_sum + base;

  threadgroup float scratch[kNumSimds];
  float m = kNoScore;
  for (uint i = tid; i < num_parts; i += kThreads) {
    if (sums[i] > 0.0f) {
      m = max(m, maxes[i]);
    }
  }
  const float total_max = decode_reduce_max(m, scratch, lane, sg);
  float s = 0.0f;
  for (uint i = tid; i < num_parts; i += kThreads) {
    if (sums[i] > 0.0f) {
      s += sums[i] * fast::exp(maxes[i] - total_max);
    }
  }
  const float total_sum = decode_reduce_sum(s, scratch, lane, sg);
  const float inv = decode_finish(total_max, total_sum, p.has_sinks != 0, p.has_sinks != 0 ? sinks[head] : 0.0f);

  // Each thread finishes whole output elements. The per-partition weights
  // are recomputed per element: a few thousand exps, and no bound on the
  // number of partitions from threadgroup memory.
  device T* o = out + (query_start_loc[seq] * p.num_heads + head) * HEAD_DIM;
  for (uint e = tid; e < HEAD_DIM; e += kThreads) {
    float x = 0.0f;
    for (uint i = 0; i < num_parts; ++i) {
      if (sums[i] > 0.0f) {
        x += fast::exp(maxes[i] - total_max) * part_acc[(base + i) * HEAD_DIM + e];
      }
    }
    o[e] = static_cast<T>(x * inv);
  }
}

#define INSTANTIATE_DECODE(T, C, NAME, HD)                                           \
  template TINYVLLM_KERNEL("paged_attention_decode_" #NAME "_hd" #HD)                \
  decltype(paged_attention_decode<T, C, HD>) paged_attention_decode<T, C, HD>;
#define INSTANTIATE_REDUCE(T, NAME, HD)                                              \
  template TINYVLLM_KERNEL("paged_attention_reduce_" #NAME "_hd" #HD)                \
  decltype(paged_attention_reduce<T, HD>) paged_attention_reduce<T, HD>;

// Head dims supported by the host (`HEAD_DIMS` in mod.rs): multiples of the
// simd width, so every lane holds the same number of elements.
#define INSTANTIATE_DECODE_HEAD_DIMS(T, C, NAME) \
  INSTANTIATE_DECODE(T, C, NAME, 32)             \
  INSTANTIATE_DECODE(T, C, NAME, 64)             \
  INSTANTIATE_DECODE(T, C, NAME, 96)             \
  INSTANTIATE_DECODE(T, C, NAME, 128)            \
  INSTANTIATE_DECODE(T, C, NAME, 256)
#define INSTANTIATE_REDUCE_HEAD_DIMS(T, NAME) \
  INSTANTIATE_REDUCE(T, NAME, 32)             \
  INSTANTIATE_REDUCE(T, NAME, 64)             \
  INSTANTIATE_REDUCE(T, NAME, 96)             \
  INSTANTIATE_REDUCE(T, NAME, 128)            \
  INSTANTIATE_REDUCE(T, NAME, 256)

INSTANTIATE_DECODE_HEAD_DIMS(float, float, f32)
INSTANTIATE_DECODE_HEAD_DIMS(half, half, f16)
INSTANTIATE_DECODE_HEAD_DIMS(float, half, f32_kvf16)
INSTANTIATE_REDUCE_HEAD_DIMS(float, f32)
INSTANTIATE_REDUCE_HEAD_DIMS(half, f16)
#if defined(__HAVE_BFLOAT__)
INSTANTIATE_DECODE_HEAD_DIMS(bfloat, bfloat, bf16)
INSTANTIATE_REDUCE_HEAD_DIMS(bfloat, bf16)
#endif
