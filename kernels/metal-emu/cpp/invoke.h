// How the emulator calls a kernel: every parameter gets its value from the
// parameter's Metal attribute, read from the source by the Rust side
// (`[[buffer(n)]]`, `[[threadgroup_position_in_grid]]`, ...) and passed as
// one ArgSpec per parameter, in order. So the bindings the host plans are
// checked against the kernel's real signature, not a copy of it.

#ifndef TINYVLLM_METAL_EMU_INVOKE_H
#define TINYVLLM_METAL_EMU_INVOKE_H

#include <cstddef>
#include <cstdint>
#include <utility>

#include "msl.h"

namespace tvm {

// Parameter attributes (the Rust side's `ArgKind`).
enum ArgKind : uint32_t {
  kBuffer = 0,
  kThreadgroupPosition = 1,
  kThreadIndexInThreadgroup = 2,
  kThreadIndexInSimdgroup = 3,
  kSimdgroupIndex = 4,
  kThreadsPerThreadgroup = 5,
  kThreadPositionInGrid = 6,
};

struct ArgSpec {
  uint32_t kind;
  uint32_t index;  // buffer index for kBuffer
};

// One bound buffer (pointer at the binding's offset, bytes to its end) or
// set_bytes data.
struct Binding {
  void* ptr;
  size_t len;
};

struct ThreadCtx {
  uint3 tg;
  uint3 threads;
  uint tid;
  const Binding* bindings;
  size_t num_bindings;
  const ArgSpec* specs;
  size_t num_specs;
};

// Ends the dispatch with an error from inside a kernel thread (runtime.cpp).
[[noreturn]] void fail(const char* what, uint32_t index);

inline const Binding& bound(const ThreadCtx& c, const ArgSpec& s, size_t align, size_t min_len) {
  if (s.kind != kBuffer) {
    fail("a buffer parameter has a thread attribute in the signature read from the source", s.index);
  }
  if (s.index >= c.num_bindings || c.bindings[s.index].ptr == nullptr) {
    fail("the host bound nothing at buffer index", s.index);
  }
  const Binding& b = c.bindings[s.index];
  if (reinterpret_cast<uintptr_t>(b.ptr) % align != 0) {
    fail("misaligned buffer offset at index", s.index);
  }
  if (b.len < min_len) {
    fail("fewer bytes bound than the parameter's type at index", s.index);
  }
  return b;
}

inline uint attribute(const ThreadCtx& c, const ArgSpec& s, int component) {
  const uint tid = c.tid;
  switch (s.kind) {
    case kThreadgroupPosition:
      return component == 0 ? c.tg.x : component == 1 ? c.tg.y : c.tg.z;
    case kThreadsPerThreadgroup:
      return component == 0 ? c.threads.x : component == 1 ? c.threads.y : c.threads.z;
    case kThreadIndexInThreadgroup:
      return tid;
    case kThreadIndexInSimdgroup:
      return tid % 32;
    case kSimdgroupIndex:
      return tid / 32;
    case kThreadPositionInGrid:
      return component == 0 ? c.tg.x * c.threads.x + tid : component == 1 ? c.tg.y : c.tg.z;
    default:
      fail("a thread-attribute parameter is a buffer in the signature read from the source", s.index);
  }
}

template <class A>
struct Get;
template <class T>
struct Get<T*> {
  static T* get(const ThreadCtx& c, const ArgSpec& s) {
    return static_cast<T*>(bound(c, s, alignof(T), 0).ptr);
  }
};
template <class P>
struct Get<P&> {
  static P& get(const ThreadCtx& c, const ArgSpec& s) {
    return *static_cast<P*>(bound(c, s, alignof(P), sizeof(P)).ptr);
  }
};
template <>
struct Get<uint> {
  static uint get(const ThreadCtx& c, const ArgSpec& s) { return attribute(c, s, 0); }
};
template <>
struct Get<uint2> {
  static uint2 get(const ThreadCtx& c, const ArgSpec& s) { return {attribute(c, s, 0), attribute(c, s, 1)}; }
};
template <>
struct Get<uint3> {
  static uint3 get(const ThreadCtx& c, const ArgSpec& s) {
    return {attribute(c, s, 0), attribute(c, s, 1), attribute(c, s, 2)};
  }
};

template <class... A, size_t... I>
void call(void (*f)(A...), const ThreadCtx& c, std::index_sequence<I...>) {
  f(Get<A>::get(c, c.specs[I])...);
}

template <class... A>
void call(void (*f)(A...), const ThreadCtx& c) {
  if (c.num_specs != sizeof...(A)) {
    fail("parameters in the source's signature differ from the compiled kernel's:", uint32_t(c.num_specs));
  }
  call(f, c, std::index_sequence_for<A...>{});
}

template <auto F>
void invoke(const ThreadCtx& c) {
  call(F, c);
}

using Invoker = void (*)(const ThreadCtx&);

// Registers kernel `host_name` (its [[host_name]]), an instantiation of the
// template function `function`.
void add_kernel(const char* host_name, const char* function, Invoker invoker);

}  // namespace tvm

#endif  // TINYVLLM_METAL_EMU_INVOKE_H
