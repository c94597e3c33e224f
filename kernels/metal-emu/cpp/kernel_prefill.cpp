// prefill_attention.metal, unmodified, compiled for the emulator; registers
// every instantiation under its [[host_name]].
#include "invoke.h"
#include "prefill_attention.metal"

#define TVM_PREFILL(T, C, NAME, HD)                                                              \
  tvm::add_kernel("paged_attention_prefill_" #NAME "_hd" #HD, "paged_attention_prefill",         \
                  &tvm::invoke<paged_attention_prefill<T, C, HD>>);
#define TVM_PREFILL_HEAD_DIMS(T, C, NAME)                                                \
  TVM_PREFILL(T, C, NAME, 32) TVM_PREFILL(T, C, NAME, 64) TVM_PREFILL(T, C, NAME, 96)    \
  TVM_PREFILL(T, C, NAME, 128) TVM_PREFILL(T, C, NAME, 256)

void tvm_register_prefill() {
  TVM_PREFILL_HEAD_DIMS(float, float, f32)
  TVM_PREFILL_HEAD_DIMS(half, half, f16)
  TVM_PREFILL_HEAD_DIMS(float, half, f32_kvf16)
  TVM_PREFILL_HEAD_DIMS(bfloat, bfloat, bf16)
}
