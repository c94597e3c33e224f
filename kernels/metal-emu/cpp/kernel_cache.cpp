// cache.metal, unmodified, compiled for the emulator; registers every
// instantiation under its [[host_name]].
#include "invoke.h"
#include "cache.metal"

void tvm_register_cache() {
  tvm::add_kernel("reshape_and_cache_f32", "reshape_and_cache", &tvm::invoke<reshape_and_cache<float, float>>);
  tvm::add_kernel("reshape_and_cache_f16", "reshape_and_cache", &tvm::invoke<reshape_and_cache<half, half>>);
  tvm::add_kernel("reshape_and_cache_f32_kvf16", "reshape_and_cache", &tvm::invoke<reshape_and_cache<float, half>>);
  tvm::add_kernel("reshape_and_cache_bf16", "reshape_and_cache", &tvm::invoke<reshape_and_cache<bfloat, bfloat>>);
}
