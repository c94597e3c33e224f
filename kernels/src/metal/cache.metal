// The KV write on Metal: one step's new K and V rows (`[T, kv_heads,
// head_dim]`) are copied into their slots of the paged pools (`[num_blocks,
// block_size, kv_heads, head_dim]`, slot = block * block_size + offset), in
// place. K and V go in one dispatch per layer, as vLLM's reshape_and_cache.
//
// In this layout one slot is one contiguous row of kv_heads * head_dim
// elements in both the source and the pool, so the write is a row copy; no
// reshaping happens on the GPU despite the name.

#include <metal_stdlib>
using namespace metal;

// Explicit instantiations name their host function with Metal attributes,
// which clang cannot parse in that position; the Linux syntax check's shim
// (shim/metal_shim.h) defines this macro empty.
#ifndef TINYVLLM_KERNEL
#define TINYVLLM_KERNEL(name) [[host_name(name)]] [[kernel]]
#endif

struct CacheWriteParams {
  uint row;        // elements per slot: kv_heads * head_dim
  uint num_slots;  // num_blocks * block_size
};

// One threadgroup per new token. Its threads walk the row together, so
// neighbouring lanes touch neighbouring elements (coalesced reads and writes).
// T: the new rows' type; C: the caches' (T, or half under float: an f16
// KV cache, each value rounded to nearest as it is written).
template <typename T, typename C>
[[kernel]] void reshape_and_cache(
    device const T* key [[buffer(0)]],              // [T, row]
    device const T* value [[buffer(1)]],            // [T, row]
    device C* k_cache [[buffer(2)]],                // [num_slots, row]
    device C* v_cache [[buffer(3)]],                // [num_slots, row]
    device const uint* slot_mapping [[buffer(4)]],  // [T]
    constant CacheWriteParams& p [[buffer(5)]],
    uint token [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint threads [[threads_per_threadgroup]]) {
  const uint slot = slot_mapping[token];
  // The host rejects such slots; the guard keeps a bad mapping from ever
  // turning into an out-of-bounds write.
  if (slot >= p.num_slots) {
    return;
  }
  device const T* k_src = key + token * p.row;
  device const T* v_src = value + token * p.row;
  device C* k_dst = k_cache + slot * p.row;
  device C* v_dst = v_cache + slot * p.row;
  for (uint i = tid; i < p.row; i += threads) {
    k_dst[i] = static_cast<C>(k_src[i]);
    v_dst[i] = static_cast<C>(v_src[i]);
  }
}

#define INSTANTIATE_CACHE_WRITE(T, C, NAME)                         \
  template TINYVLLM_KERNEL("reshape_and_cache_" #NAME)              \
  decltype(reshape_and_cache<T, C>) reshape_and_cache<T, C>;

INSTANTIATE_CACHE_WRITE(float, float, f32)
INSTANTIATE_CACHE_WRITE(half, half, f16)
INSTANTIATE_CACHE_WRITE(float, half, f32_kvf16)
#if defined(__HAVE_BFLOAT__)
INSTANTIATE_CACHE_WRITE(bfloat, bfloat, bf16)
#endif
