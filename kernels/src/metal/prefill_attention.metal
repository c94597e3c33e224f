// Paged attention for prompt chunks (q_len > 1) on Metal, flash-attention
// style: causal attention of a chunk of new tokens over the cached prefix
// and the chunk itself, all read in place from the paged pools through the
// block table, tile by tile, with an online softmax accumulated in float.
// Same flattened varlen metadata as the CPU kernel (kernels/src/cpu).
//
// Grid: (work item, kv head); threadgroup: 4 simdgroups of 32 lanes. A work
// item is 16 consecutive "rows" of one sequence for one kv head, where row
// r = i * group + j is query i of the chunk under query head
// kv_head * group + j (GQA): all heads of a group share every K/V tile
// loaded, as in the CPU kernel. Each simdgroup owns 4 rows. Per tile of keys
// the K and V rows are staged in threadgroup memory once, every simdgroup
// scores its rows against them (lane j keeps key j's score), updates its
// running max and sum with one exp per lane, and accumulates V. Attention
// sinks (gpt-oss): each head's learned logit joins its rows' denominators.

#include <metal_stdlib>
using namespace metal;

// Explicit instantiations name their host function with Metal attributes,
// which clang cannot parse in that position; the Linux syntax check's shim
// (shim/metal_shim.h) defines this macro empty.
#ifndef TINYVLLM_KERNEL
#define TINYVLLM_KERNEL(name) [[host_name(name)]] [[kernel]]
#endif

static constant constexpr const uint kSimdWidth = 32;
static constant constexpr const uint kNumSimds = 4;
static constant constexpr const uint kThreads = kSimdWidth * kNumSimds;
static constant constexpr const uint kRowsPerSimd = 4;
// Rows per work item (the host's PREFILL_ROWS).
static constant constexpr const uint kRows = kNumSimds * kRowsPerSimd;
// Threadgroup bytes per K (or V) tile, which sets the keys per tile.
static constant constexpr const uint kTileBytes = 8192;
// Finite stand-in for -inf: the library is built with fast math.
static constant constexpr const float kNoScore = -1e30f;

struct PrefillParams {
  uint num_heads;
  uint num_kv_heads;
  uint block_size;
  uint max_blocks;      // row length of the flattened block tables
  uint sliding_window;  // 0: none; else a query at p sees keys > p - window
  float scale;
  uint has_sinks;  // 1: each head's sink logit joins its softmax
};

// The first key position a query at `pos` sees.
inline uint prefill_first_visible(uint pos, uint window) {
  return (window != 0 && pos + 1 > window) ? pos + 1 - window : 0;
}

// T: the queries' and output's type; C: the caches' (T, or half under
// float queries), also the type of the staged tiles.
template <typename T, typename C, uint HEAD_DIM>
[[kernel]] void paged_attention_prefill(
    device const T* q [[buffer(0)]],                  // [num_tokens, num_heads, HEAD_DIM]
    device const C* k_cache [[buffer(1)]],            // [num_blocks, block_size, num_kv_heads, HEAD_DIM]
    device const C* v_cache [[buffer(2)]],            // same
    device const uint* query_start_loc [[buffer(3)]], // [S + 1]
    device const uint* context_lens [[buffer(4)]],    // [S]
    device const uint* block_tables [[buffer(5)]],    // [S, max_blocks]
    device const uint* items [[buffer(6)]],           // [num_items, 2]: (sequence, first row)
    device T* out [[buffer(7)]],                      // [num_tokens, num_heads, HEAD_DIM]
    constant PrefillParams& p [[buffer(8)]],
    device const float* sinks [[buffer(9)]],          // [num_heads] under has_sinks
    uint2 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  constexpr uint kPerLane = HEAD_DIM / kSimdWidth;
  // At most one key per lane, so a tile's scores fit one per lane.
  constexpr uint kFit = kTileBytes / (HEAD_DIM * sizeof(C));
  constexpr uint kTileKeys = kFit < kSimdWidth ? kFit : kSimdWidth;
  threadgroup C k_tile[kTileKeys * HEAD_DIM];
  threadgroup C v_tile[kTileKeys * HEAD_DIM];
  threadgroup uint tile_slot[kTileKeys];

  const uint seq = items[2 * tg.x];
  const uint r0 = items[2 * tg.x + 1];
  const uint kv_head = tg.y;
  const uint group = p.num_heads / p.num_kv_heads;
  const uint q_start = query_start_loc[seq];
  const uint q_len = query_start_loc[seq + 1] - q_start;
  const uint ctx = context_lens[seq];
  const uint first_pos = ctx - q_len;  // position of query 0 of the chunk
  const uint r_end = min(r0 + kRows, q_len * group);

  // This simdgroup's rows: queries pre-scaled, lane l holding elements
  // l, l + 32, ... (coalesced loads), accumulators and softmax state.
  float qv[kRowsPerSimd][kPerLane];
  float acc[kRowsPerSimd][kPerLane];
  float run_max[kRowsPerSimd];
  float run_sum[kRowsPerSimd];
  uint pos[kRowsPerSimd];
  bool live[kRowsPerSimd];  // rows past the item's end only join the barriers
  for (uint r = 0; r < kRowsPerSimd; ++r) {
    const uint flat = r0 + sg * kRowsPerSimd + r;
    live[r] = flat < r_end;
    const uint qi = live[r] ? flat / group : 0;
    const uint head = kv_head * group + (live[r] ? flat % group : 0);
    pos[r] = first_pos + qi;
    device const T* q_row = q + ((q_start + qi) * p.num_heads + head) * HEAD_DIM;
    for (uint i = 0; i < kPerLane; ++i) {
      qv[r][i] = live[r] ? float(q_row[lane + i * kSimdWidth]) * p.scale : 0.0f;
      acc[r][i] = 0.0f;
    }
    run_max[r] = kNoScore;
    run_sum[r] = 0.0f;
  }

  // Keys any row of the item sees: from the first row's window start to the
  // last row's own position (causal).
  const uint key_begin = prefill_first_visible(first_pos + r0 / group, p.sliding_window);
  const uint key_end = first_pos + (r_end - 1) / group + 1;
  device const uint* table = block_tables + seq * p.max_blocks;
  const uint slot_stride = p.num_kv_heads * HEAD_DIM;  // elements per slot

  for (uint k0 = key_begin; k0 < key_end; k0 += kTileKeys) {
    const uint n = min(kTileKeys, key_end - k0);

    // Stage the tile's K and V rows of this kv head.
    if (tid < n) {
      const uint t = k0 + tid;
      tile_slot[tid] = table[t / p.block_size] * p.block_size + t % p.block_size;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint f = tid; f < n * HEAD_DIM; f += kThreads) {
      const uint src = tile_slot[f / HEAD_DIM] * slot_stride + kv_head * HEAD_DIM + f % HEAD_DIM;
      k_tile[f] = k_cache[src];
      v_tile[f] = v_cache[src];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Scores: each K row is read once for all of the simdgroup's rows.
    float score[kRowsPerSimd];
    for (uint r = 0; r < kRowsPerSimd; ++r) {
      score[r] = kNoScore;
    }
    for (uint j = 0; j < n; ++j) {
      float kr[kPerLane];
      for (uint i = 0; i < kPerLane; ++i) {
        kr[i] = float(k_tile[j * HEAD_DIM + lane + i * kSimdWidth]);
      }
      for (uint r = 0; r < kRowsPerSimd; ++r) {
        float d = 0.0f;
        for (uint i = 0; i < kPerLane; ++i) {
          d += qv[r][i] * kr[i];
        }
        d = simd_sum(d);
        if (lane == j) {
          score[r] = d;
        }
      }
    }

    // Online softmax per row over the keys it sees in this tile.
    const uint key = k0 + lane;
    float weight[kRowsPerSimd];
    for (uint r = 0; r < kRowsPerSimd; ++r) {
      const bool visible = live[r] && lane < n && key <= pos[r] &&
                           key >= prefill_first_visible(pos[r], p.sliding_window);
      weight[r] = 0.0f;
      if (!simd_any(visible)) {
        continue;  // uniform across the simdgroup: nothing here for this row
      }
      const float new_max = max(run_max[r], simd_max(visible ? score[r] : kNoScore));
      const float correction = fast::exp(run_max[r] - new_max);
      weight[r] = visible ? fast::exp(score[r] - new_max) : 0.0f;
      run_sum[r] = run_sum[r] * correction + simd_sum(weight[r]);
      run_max[r] = new_max;
      for (uint i = 0; i < kPerLane; ++i) {
        acc[r][i] *= correction;
      }
    }

    // Values: lane j's weight is broadcast to the simdgroup for key j.
    for (uint j = 0; j < n; ++j) {
      float vr[kPerLane];
      for (uint i = 0; i < kPerLane; ++i) {
        vr[i] = float(v_tile[j * HEAD_DIM + lane + i * kSimdWidth]);
      }
      for (uint r = 0; r < kRowsPerSimd; ++r) {
        const float w = simd_shuffle(weight[r], ushort(j));
        for (uint i = 0; i < kPerLane; ++i) {
          acc[r][i] += w * vr[i];
        }
      }
    }
    // The next tile overwrites the staged rows.
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // Every live row saw at least its own key, so its sum is positive.
  for (uint r = 0; r < kRowsPerSimd; ++r) {
    if (!live[r]) {
      continue;
    }
    const uint flat = r0 + sg * kRowsPerSimd + r;
    const uint head = kv_head * group + flat % group;
    device T* o = out + ((q_start + flat / group) * p.num_heads + head) * HEAD_DIM;
    float inv = run_sum[r] > 0.0f ? 1.0f / run_sum[r] : 0.0f;
    if (p.has_sinks != 0) {
      // The sink's logit joins the denominator: exp(m - top) / (s exp(m -
      // top) + exp(sink - top)), top = max(m, sink).
      const float top = max(run_max[r], sinks[head]);
      const float keep = fast::exp(run_max[r] - top);
      inv = keep / (run_sum[r] * keep + fast::exp(sinks[head] - top));
    }
    for (uint i = 0; i < kPerLane; ++i) {
      o[lane + i * kSimdWidth] = static_cast<T>(acc[r][i] * inv);
    }
  }
}

#define INSTANTIATE_PREFILL(T, C, NAME, HD)                                        \
  template TINYVLLM_KERNEL("paged_attention_prefill_" #NAME "_hd" #HD)             \
  decltype(paged_attention_prefill<T, C, HD>) paged_attention_prefill<T, C, HD>;

// The same head dims as paged_attention.metal (`HEAD_DIMS` in mod.rs).
#define INSTANTIATE_PREFILL_HEAD_DIMS(T, C, NAME) \
  INSTANTIATE_PREFILL(T, C, NAME, 32)             \
  INSTANTIATE_PREFILL(T, C, NAME, 64)             \
  INSTANTIATE_PREFILL(T, C, NAME, 96)             \
  INSTANTIATE_PREFILL(T, C, NAME, 128)            \
  INSTANTIATE_PREFILL(T, C, NAME, 256)

INSTANTIATE_PREFILL_HEAD_DIMS(float, float, f32)
INSTANTIATE_PREFILL_HEAD_DIMS(half, half, f16)
INSTANTIATE_PREFILL_HEAD_DIMS(float, half, f32_kvf16)
#if defined(__HAVE_BFLOAT__)
INSTANTIATE_PREFILL_HEAD_DIMS(bfloat, bfloat, bf16)
#endif
