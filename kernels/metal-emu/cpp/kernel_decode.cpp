// paged_attention.metal, unmodified, compiled for the emulator; registers
// every instantiation under its [[host_name]].
#include "invoke.h"
#include "paged_attention.metal"

#define TVM_DECODE(T, C, NAME, HD)                                                               \
  tvm::add_kernel("paged_attention_decode_" #NAME "_hd" #HD, "paged_attention_decode",           \
                  &tvm::invoke<paged_attention_decode<T, C, HD>>);
#define TVM_REDUCE(T, NAME, HD)                                                                  \
  tvm::add_kernel("paged_attention_reduce_" #NAME "_hd" #HD, "paged_attention_reduce",           \
                  &tvm::invoke<paged_attention_reduce<T, HD>>);
#define TVM_DECODE_HEAD_DIMS(T, C, NAME)                                                     \
  TVM_DECODE(T, C, NAME, 32) TVM_DECODE(T, C, NAME, 64) TVM_DECODE(T, C, NAME, 96)           \
  TVM_DECODE(T, C, NAME, 128) TVM_DECODE(T, C, NAME, 256)
#define TVM_REDUCE_HEAD_DIMS(T, NAME) \
  TVM_REDUCE(T, NAME, 32) TVM_REDUCE(T, NAME, 64) TVM_REDUCE(T, NAME, 96) TVM_REDUCE(T, NAME, 128) TVM_REDUCE(T, NAME, 256)

void tvm_register_decode() {
  TVM_DECODE_HEAD_DIMS(float, float, f32)
  TVM_DECODE_HEAD_DIMS(half, half, f16)
  TVM_DECODE_HEAD_DIMS(float, half, f32_kvf16)
  TVM_DECODE_HEAD_DIMS(bfloat, bfloat, bf16)
  TVM_REDUCE_HEAD_DIMS(float, f32)
  TVM_REDUCE_HEAD_DIMS(half, f16)
  TVM_REDUCE_HEAD_DIMS(bfloat, bf16)
}
