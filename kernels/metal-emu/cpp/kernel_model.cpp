// model.metal, unmodified, compiled for the emulator; registers every
// instantiation under its [[host_name]].
#include "invoke.h"
#include "model.metal"

#define TVM_WEIGHT_KERNELS(W, NAME)                                                              \
  tvm::add_kernel("embed_rows_" #NAME, "embed_rows", &tvm::invoke<embed_rows<W>>);              \
  tvm::add_kernel("matmul_" #NAME, "matmul", &tvm::invoke<matmul<W>>);

#define TVM_MATMUL_ID(W, NAME) tvm::add_kernel("matmul_id_" #NAME, "matmul_id", &tvm::invoke<matmul_id<W>>);

void tvm_register_model() {
  TVM_WEIGHT_KERNELS(float, f32)
  TVM_WEIGHT_KERNELS(half, f16)
  TVM_WEIGHT_KERNELS(bfloat, bf16)
  tvm::add_kernel("matmul_q8_0", "matmul", &tvm::invoke<matmul<BlockQ8_0>>);
  tvm::add_kernel("matmul_q4_0", "matmul", &tvm::invoke<matmul<BlockQ4_0>>);
  tvm::add_kernel("matmul_q4_k", "matmul", &tvm::invoke<matmul<BlockQ4K>>);
  tvm::add_kernel("matmul_q6_k", "matmul", &tvm::invoke<matmul<BlockQ6K>>);
  tvm::add_kernel("matmul_mxfp4", "matmul", &tvm::invoke<matmul<BlockMxfp4>>);
  TVM_MATMUL_ID(float, f32)
  TVM_MATMUL_ID(half, f16)
  TVM_MATMUL_ID(bfloat, bf16)
  TVM_MATMUL_ID(BlockQ8_0, q8_0)
  TVM_MATMUL_ID(BlockQ4_0, q4_0)
  TVM_MATMUL_ID(BlockQ4K, q4_k)
  TVM_MATMUL_ID(BlockQ6K, q6_k)
  TVM_MATMUL_ID(BlockMxfp4, mxfp4)
  tvm::add_kernel("moe_route", "moe_route", &tvm::invoke<moe_route>);
  tvm::add_kernel("moe_group", "moe_group", &tvm::invoke<moe_group>);
  tvm::add_kernel("moe_combine", "moe_combine", &tvm::invoke<moe_combine>);
  tvm::add_kernel("rms_norm", "rms_norm", &tvm::invoke<rms_norm>);
  tvm::add_kernel("rope_qkv_cache_f32", "rope_qkv_cache", &tvm::invoke<rope_qkv_cache<float>>);
  tvm::add_kernel("rope_qkv_cache_f16", "rope_qkv_cache", &tvm::invoke<rope_qkv_cache<half>>);
}
