// Just enough of the Metal Shading Language, as plain C++17 declarations,
// for `g++`/`clang++ -std=c++17 -fsyntax-only` to parse our kernels and
// instantiate their templates on a machine without Apple's compiler
// (tools/check_metal_syntax.sh). Nothing here is ever compiled into code or
// run: the types have no definitions of their members and the functions no
// bodies. It catches typos, type mismatches, missing declarations and bad
// instantiations; `xcrun metal` remains the real judge.
//
// Used with `-include` this file, plus `-I` its directory, where a file
// named `metal_stdlib` stands in for Metal's header.
//
// Attributes (`[[buffer(n)]]`, `[[kernel]]`, `[[host_name("...")]]`,
// `[[thread_position_in_grid]]`, ...) are standard C++ attribute syntax that
// the compilers ignore with a warning; the script turns that warning off
// (-Wno-attributes / -Wno-unknown-attributes) rather than hiding them here.

#ifndef TINYVLLM_METAL_SHIM_H
#define TINYVLLM_METAL_SHIM_H

// Address spaces and the kernel qualifier are keywords in MSL.
#define device
#define constant
#define threadgroup
#define thread
#define kernel

// The kernels' explicit instantiations carry [[host_name]] and [[kernel]],
// which clang cannot parse on an explicit instantiation; the attributes mean
// nothing off Apple's compiler, so the shim drops them.
#define TINYVLLM_KERNEL(name)

// Metal >= 3.1 defines this when `bfloat` exists; check those kernels too.
#define __HAVE_BFLOAT__ 1

#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define FLT_MAX 3.40282347e+38f
#define HALF_MAX 65504.0f

// Scalar types.
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef __SIZE_TYPE__ size_t;
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef unsigned long ulong;

// 16-bit floats: arithmetic goes through float, which is all the kernels
// rely on (they widen before computing and narrow when storing).
struct half {
  half();
  half(float);
  operator float() const;
};

struct bfloat {
  bfloat();
  bfloat(float);
  operator float() const;
};

// Vector types: components, indexing, and component-wise arithmetic with
// vectors and scalars.
#define TINYVLLM_SHIM_VEC_MEMBERS(T)   \
  T& operator[](int);                  \
  const T& operator[](int) const;      \
  vec& operator+=(const vec&);         \
  vec& operator-=(const vec&);         \
  vec& operator*=(const vec&);         \
  vec& operator/=(const vec&);         \
  vec& operator*=(T);

template <typename T, int N>
struct vec;

template <typename T>
struct vec<T, 2> {
  T x, y;
  vec();
  explicit vec(T);
  vec(T, T);
  TINYVLLM_SHIM_VEC_MEMBERS(T)
};

template <typename T>
struct vec<T, 3> {
  T x, y, z;
  vec();
  explicit vec(T);
  vec(T, T, T);
  TINYVLLM_SHIM_VEC_MEMBERS(T)
};

template <typename T>
struct vec<T, 4> {
  T x, y, z, w;
  vec();
  explicit vec(T);
  vec(T, T, T, T);
  vec(vec<T, 2>, vec<T, 2>);
  TINYVLLM_SHIM_VEC_MEMBERS(T)
};

// The scalar operand is a non-deduced context, so it converts (float4 * 2).
template <typename T>
struct shim_identity {
  typedef T type;
};
#define TINYVLLM_SHIM_VEC_OP(OP)                                                              \
  template <typename T, int N> vec<T, N> operator OP(const vec<T, N>&, const vec<T, N>&);     \
  template <typename T, int N>                                                                \
  vec<T, N> operator OP(const vec<T, N>&, typename shim_identity<T>::type);                   \
  template <typename T, int N>                                                                \
  vec<T, N> operator OP(typename shim_identity<T>::type, const vec<T, N>&);
TINYVLLM_SHIM_VEC_OP(+)
TINYVLLM_SHIM_VEC_OP(-)
TINYVLLM_SHIM_VEC_OP(*)
TINYVLLM_SHIM_VEC_OP(/)
template <typename T, int N> vec<T, N> operator-(const vec<T, N>&);

#define TINYVLLM_SHIM_VEC_TYPES(T)   \
  typedef vec<T, 2> T##2;            \
  typedef vec<T, 3> T##3;            \
  typedef vec<T, 4> T##4;

TINYVLLM_SHIM_VEC_TYPES(float)
TINYVLLM_SHIM_VEC_TYPES(half)
TINYVLLM_SHIM_VEC_TYPES(bfloat)
TINYVLLM_SHIM_VEC_TYPES(int)
TINYVLLM_SHIM_VEC_TYPES(uint)
TINYVLLM_SHIM_VEC_TYPES(short)
TINYVLLM_SHIM_VEC_TYPES(ushort)
TINYVLLM_SHIM_VEC_TYPES(uchar)

namespace metal {

// Common and math functions. Templates, so mixed argument types (which
// MSL would not resolve either) fail here too.
template <typename T> T max(T, T);
template <typename T> T min(T, T);
template <typename T> T clamp(T, T, T);
template <typename T> T abs(T);
template <typename T> T select(T, T, bool);
template <typename T, int N> T dot(vec<T, N>, vec<T, N>);
template <typename To, typename From> To as_type(From);

#define TINYVLLM_SHIM_MATH(NAME)                   \
  float NAME(float);                               \
  half NAME(half);                                 \
  template <int N> vec<float, N> NAME(vec<float, N>);

#define TINYVLLM_SHIM_MATH_SET  \
  TINYVLLM_SHIM_MATH(exp)       \
  TINYVLLM_SHIM_MATH(exp2)      \
  TINYVLLM_SHIM_MATH(log)       \
  TINYVLLM_SHIM_MATH(log2)      \
  TINYVLLM_SHIM_MATH(sqrt)      \
  TINYVLLM_SHIM_MATH(rsqrt)     \
  TINYVLLM_SHIM_MATH(tanh)      \
  TINYVLLM_SHIM_MATH(fabs)      \
  TINYVLLM_SHIM_MATH(floor)     \
  TINYVLLM_SHIM_MATH(ceil)

TINYVLLM_SHIM_MATH_SET
float pow(float, float);
float fma(float, float, float);
bool isnan(float);
bool isinf(float);

namespace fast {
TINYVLLM_SHIM_MATH_SET
}  // namespace fast

namespace precise {
TINYVLLM_SHIM_MATH_SET
}  // namespace precise

// SIMD-group functions (32 lanes on Apple GPUs).
template <typename T> T simd_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_min(T);
template <typename T> T simd_prefix_exclusive_sum(T);
template <typename T> T simd_prefix_inclusive_sum(T);
template <typename T> T simd_shuffle(T, ushort);
template <typename T> T simd_shuffle_down(T, ushort);
template <typename T> T simd_shuffle_up(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T> T simd_broadcast(T, ushort);
template <typename T> T simd_broadcast_first(T);
bool simd_any(bool);
bool simd_all(bool);

// Barriers.
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
mem_flags operator|(mem_flags, mem_flags);
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);

}  // namespace metal

#endif  // TINYVLLM_METAL_SHIM_H
