// The subset of the Metal Shading Language our kernels use, as C++17 that
// runs on the CPU under the emulator's fibers (runtime.cpp). Unlike the
// declarations-only shim of the syntax check (kernels/src/metal/shim), every
// type and function here has a body, and every SIMD-group function and
// barrier is a synchronisation point resolved by the scheduler over the 32
// lanes of a SIMD group.
//
// Address spaces are plain memory. A `threadgroup` variable must be one copy
// shared by the fibers of the threadgroup that runs (one at a time), which
// C++ can only express with `static`, a keyword not allowed on the
// parameters that also carry `threadgroup`. So build.rs rewrites each
// kernel-scope `threadgroup T name[N];` line to `static T name[N];
// tvm::threadgroup_memory(name, sizeof(name));` (same line, nothing else
// changed), and the macro below covers the parameters. threadgroup_memory
// poisons the array with NaN (all-ones bytes) when the first fiber of a
// threadgroup reaches its declaration.

#ifndef TINYVLLM_METAL_EMU_MSL_H
#define TINYVLLM_METAL_EMU_MSL_H

#include <cmath>
#include <cstdint>
#include <cstring>

#define device
#define constant
#define thread
#define kernel
#define threadgroup

// Explicit instantiations name their host function with Metal attributes;
// registration by name happens in the kernel units (kernel_*.cpp).
#define TINYVLLM_KERNEL(name)

// The emulator has bfloat (Metal 3.1's), like the GPUs the host plans for.
#define __HAVE_BFLOAT__ 1

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;

// 16-bit floats, stored as bits; conversions round to nearest even as the
// GPU's do, arithmetic happens in float (the kernels widen first).
struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(from_float(f)) {}
  operator float() const { return to_float(bits); }

  static uint16_t from_float(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t mag = x & 0x7fffffffu;
    if (mag >= 0x7f800000u) {  // inf or nan
      return uint16_t(sign | 0x7c00u | (mag > 0x7f800000u ? 0x200u : 0u));
    }
    if (mag >= 0x477ff000u) {  // rounds past the largest half
      return uint16_t(sign | 0x7c00u);
    }
    if (mag < 0x38800000u) {  // subnormal half (or zero)
      float a;
      std::memcpy(&a, &mag, 4);
      // 2^-24 is the smallest subnormal; rint rounds half to even.
      return uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.0f)));
    }
    const uint32_t rounded = mag + 0xfffu + ((mag >> 13) & 1u);
    return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
  }
  static float to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    uint32_t x;
    if (exp == 0x1f) {
      x = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
      x = sign | ((exp + 112u) << 23) | (man << 13);
    } else {
      float f = float(man) / 16777216.0f;
      return sign ? -f : f;
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
  }
};

struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((x >> 16) | 0x40u);  // keep nan a (quiet) nan
    } else {
      bits = uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    }
  }
  operator float() const {
    const uint32_t x = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &x, 4);
    return f;
  }
};

struct uint2 {
  uint x, y;
};
struct uint3 {
  uint x, y, z;
};

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };

namespace tvm {

// What a fiber waits at; every kind but Barrier is a SIMD-group collective.
enum class Op : uint8_t { Sum, Max, Min, Shuffle, Any, All, Barrier };
enum class Type : uint8_t { F32, U32, I32, Bool };

// Suspends the calling fiber at a synchronisation point until the scheduler
// resolves it; returns the collective's result for this lane (runtime.cpp).
uint64_t sync_point(Op op, Type type, uint64_t value, uint32_t lane_arg, int line);

// Poisons `bytes` of threadgroup memory at `p` the first time a fiber of the
// running threadgroup declares it (runtime.cpp).
void threadgroup_memory(void* p, size_t bytes);

template <typename T>
struct TypeOf;
template <>
struct TypeOf<float> {
  static constexpr Type value = Type::F32;
};
template <>
struct TypeOf<uint> {
  static constexpr Type value = Type::U32;
};
template <>
struct TypeOf<int> {
  static constexpr Type value = Type::I32;
};

template <typename T>
uint64_t pack(T x) {
  uint64_t v = 0;
  std::memcpy(&v, &x, sizeof(T));
  return v;
}
template <typename T>
T unpack(uint64_t v) {
  T x;
  std::memcpy(&x, &v, sizeof(T));
  return x;
}
template <typename T>
T collective(Op op, T x, uint32_t lane_arg, int line) {
  return unpack<T>(sync_point(op, TypeOf<T>::value, pack(x), lane_arg, line));
}

}  // namespace tvm

namespace metal {

template <typename T>
inline T max(T a, T b) {
  return a > b ? a : b;
}
template <typename T>
inline T min(T a, T b) {
  return a < b ? a : b;
}
// NaN propagates (unlike fmax): a poisoned value read by mistake must show
// in the output, not vanish in a max.
inline float max(float a, float b) { return (a != a || b != b) ? NAN : (a > b ? a : b); }
inline float min(float a, float b) { return (a != a || b != b) ? NAN : (a < b ? a : b); }

template <typename T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
// Reinterprets the bits (Metal's as_type; sizes must match).
template <typename To, typename From>
inline To as_type(From x) {
  static_assert(sizeof(To) == sizeof(From), "as_type between types of one size");
  To y;
  std::memcpy(&y, &x, sizeof(To));
  return y;
}

inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float floor(float x) { return std::floor(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float ceil(float x) { return std::ceil(x); }
inline float sqrt(float x) { return std::sqrt(x); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }

namespace fast {
inline float exp(float x) { return std::exp(x); }
}  // namespace fast
namespace precise {
inline float exp(float x) { return std::exp(x); }
}  // namespace precise

// `line` is the caller's: lanes of one SIMD group must meet at the same
// call, or they have diverged.
template <typename T>
T simd_sum(T x, int line = __builtin_LINE()) {
  return tvm::collective(tvm::Op::Sum, x, 0, line);
}
template <typename T>
T simd_max(T x, int line = __builtin_LINE()) {
  return tvm::collective(tvm::Op::Max, x, 0, line);
}
template <typename T>
T simd_min(T x, int line = __builtin_LINE()) {
  return tvm::collective(tvm::Op::Min, x, 0, line);
}
template <typename T>
T simd_shuffle(T x, ushort lane, int line = __builtin_LINE()) {
  return tvm::collective(tvm::Op::Shuffle, x, lane, line);
}
template <typename T>
T simd_broadcast(T x, ushort lane, int line = __builtin_LINE()) {
  return tvm::collective(tvm::Op::Shuffle, x, lane, line);
}
inline bool simd_any(bool x, int line = __builtin_LINE()) {
  return tvm::sync_point(tvm::Op::Any, tvm::Type::Bool, x, 0, line) != 0;
}
inline bool simd_all(bool x, int line = __builtin_LINE()) {
  return tvm::sync_point(tvm::Op::All, tvm::Type::Bool, x, 0, line) != 0;
}

inline void threadgroup_barrier(mem_flags, int line = __builtin_LINE()) {
  tvm::sync_point(tvm::Op::Barrier, tvm::Type::Bool, 0, 0, line);
}

}  // namespace metal

#endif  // TINYVLLM_METAL_EMU_MSL_H
