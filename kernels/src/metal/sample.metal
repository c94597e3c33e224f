// Sampling in the step's command buffer: one threadgroup per row of logits
// draws that row's token as the host sampler (worker/src/runner/sampler.rs)
// does, in vLLM's order: the structured-output mask, min_tokens bans, logit
// bias, the repetition, frequency and presence penalties, then the argmax
// (greedy) or temperature, top-k and min-p as floors below the top token,
// top-p, and one seeded draw. It also reports what the row's logprobs need
// (the raw row's max and exp-sum, the chosen and the top raw logits, as
// they are), so
// only a few words per row come back to the host.
//
// GPUs have no cheap sort, so each threshold is found by bisection on the
// values' bits (a float's order key is monotone in the float), each probe a
// reduction over the row in this threadgroup: at most 32 probes for top-k's
// k-th value, 32 for top-p's smallest kept weight and 32 for the draw's
// place in the nucleus. A step thus costs one dispatch for every row,
// whatever the vocabulary and the parameters.
//
// The host compiles this library without fast math: masks are -inf, and a
// model may produce NaN or inf logits, which fast math may assume away.
// `exp_nonpositive` is the host's, operation for operation, so seeded draws
// give the host's tokens but where f32 sums (the host sums in f64) put a
// draw on the other side of a boundary.
//
// The host side is kernels/src/metal/step/sample.rs.

#include <metal_stdlib>
using namespace metal;

static constant constexpr const uint kSampleSimdWidth = 32;
static constant constexpr const uint kSampleThreads = 256;
static constant constexpr const uint kSampleSimds = kSampleThreads / kSampleSimdWidth;
// The most top logprobs a row reports (common::MAX_LOGPROBS).
static constant constexpr const uint kMaxTopLogprobs = 20;
// Words a row writes: token, top count, the raw max and exp-sum, the
// chosen token's raw logit, then (id, raw logit) per top token.
static constant constexpr const uint kSampleOutWords = 5 + 2 * kMaxTopLogprobs;
static constant constexpr const uint kNone = 0xffffffffu;

// TokenEdit flags.
static constant constexpr const uint kEditBanned = 1;  // min_tokens: -inf
static constant constexpr const uint kEditBias = 2;    // logit_bias: + bias
static constant constexpr const uint kEditSeen = 4;    // in the prompt or output: repetition penalty

struct SampleParams {
  float temperature;  // 0: greedy
  uint top_k;         // 0: off
  float top_p;        // 1: off
  float min_p;        // 0: off
  float repetition;
  float frequency;
  float presence;
  float uniform;      // the row's draw in [0, 1)
  uint edits_start;   // the row's TokenEdits, one per token it changes
  uint edits_count;
  uint mask_row;      // kNone: no structured-output mask
  uint top_logprobs;  // kNone: no logprobs; else how many top tokens
};

struct TokenEdit {
  uint token;
  uint flags;
  float bias;
  uint count;  // times generated (0 unless a frequency or presence penalty applies)
};

struct SampleDims {
  uint vocab;
  uint mask_words;
};

// A float's place in the total order (-inf < finite < inf), as an unsigned
// integer; NaN never reaches it (rows are cleaned first). 0 is below every
// value's key and stands for "nothing".
inline uint order_key(float x) {
  const uint b = as_type<uint>(x);
  return (b & 0x80000000u) != 0 ? ~b : (b | 0x80000000u);
}

inline float from_key(uint k) {
  return as_type<float>((k & 0x80000000u) != 0 ? (k & 0x7fffffffu) : ~k);
}

// NaN logits are impossible tokens, as on the host.
inline float clean(float x) {
  return isnan(x) ? -INFINITY : x;
}

// e^x for x <= 0: the host sampler's `exp_nonpositive` (Cephes' expf without
// branches), the same operations in the same order.
inline float exp_nonpositive(float x) {
  const float xc = x > -87.0f ? x : -87.0f;
  const float t = xc * 1.4426950408889634f + 12582912.0f;
  const float n = t - 12582912.0f;
  const float r = xc - n * 0.6933594f - n * -2.1219444e-4f;
  float y = 1.9875691e-4f;
  y = y * r + 1.3981999e-3f;
  y = y * r + 8.333452e-3f;
  y = y * r + 4.1665796e-2f;
  y = y * r + 0.16666665f;
  y = y * r + 0.5f;
  y = y * r * r + r + 1.0f;
  const float scale = as_type<float>((as_type<uint>(t) - (0x4B400000u - 127u)) << 23);
  return x < -87.0f ? 0.0f : y * scale;
}

inline bool is_allowed(device const uint* mask, uint mask_words, uint i) {
  return mask == nullptr || (i / 32 < mask_words && ((mask[i / 32] >> (i % 32)) & 1u) != 0);
}

// ---------------------------------------------------------------------------
// Threadgroup reductions. Every thread calls them, with its own part, and
// gets the whole; the order of the sums is fixed.

inline float group_sum(float v, threadgroup float* partial, uint lane, uint sg) {
  v = simd_sum(v);
  if (lane == 0) {
    partial[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < kSampleSimds; ++s) {
    total += partial[s];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

inline uint group_sum_u(uint v, threadgroup uint* partial, uint lane, uint sg) {
  v = simd_sum(v);
  if (lane == 0) {
    partial[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint total = 0;
  for (uint s = 0; s < kSampleSimds; ++s) {
    total += partial[s];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return total;
}

inline uint group_max_u(uint v, threadgroup uint* partial, uint lane, uint sg) {
  v = simd_max(v);
  if (lane == 0) {
    partial[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint best = 0;
  for (uint s = 0; s < kSampleSimds; ++s) {
    best = max(best, partial[s]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return best;
}

inline uint group_min_u(uint v, threadgroup uint* partial, uint lane, uint sg) {
  v = simd_min(v);
  if (lane == 0) {
    partial[sg] = v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint best = kNone;
  for (uint s = 0; s < kSampleSimds; ++s) {
    best = min(best, partial[s]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return best;
}

struct Best {
  uint key;
  uint index;
};

// The largest key offered and the lowest index offering it (kNone if no
// thread offered a key above 0).
inline Best group_best(uint key, uint index, threadgroup uint* partial, uint lane, uint sg) {
  Best b;
  b.key = group_max_u(key, partial, lane, sg);
  b.index = group_min_u(key == b.key && b.key != 0 ? index : kNone, partial, lane, sg);
  return b;
}

// ---------------------------------------------------------------------------
// The passes over a row

// How many of the row's values are finite and at least from_key(key).
inline uint count_at_least(device const float* row, uint vocab, uint key, threadgroup uint* partial, uint tid,
                           uint lane, uint sg) {
  uint c = 0;
  for (uint i = tid; i < vocab; i += kSampleThreads) {
    const float v = row[i];
    c += (v > -INFINITY && order_key(v) >= key) ? 1u : 0u;
  }
  return group_sum_u(c, partial, lane, sg);
}

// Weight of the positive weights at least from_key(key).
inline float mass_at_least(device const float* w, uint vocab, uint key, threadgroup float* partial, uint tid,
                           uint lane, uint sg) {
  float m = 0.0f;
  for (uint i = tid; i < vocab; i += kSampleThreads) {
    const float x = w[i];
    m += (x > 0.0f && order_key(x) >= key) ? x : 0.0f;
  }
  return group_sum(m, partial, lane, sg);
}

inline uint count_equal(device const float* w, uint vocab, float v, threadgroup uint* partial, uint tid, uint lane,
                        uint sg) {
  uint c = 0;
  for (uint i = tid; i < vocab; i += kSampleThreads) {
    c += w[i] == v ? 1u : 0u;
  }
  return group_sum_u(c, partial, lane, sg);
}

struct Span {
  uint begin;
  uint end;
};

// Thread t's contiguous part of the row, for the passes that go in id order.
inline Span chunk_of(uint vocab, uint tid) {
  const uint size = (vocab + kSampleThreads - 1) / kSampleThreads;
  Span s;
  s.begin = min(tid * size, vocab);
  s.end = min(s.begin + size, vocab);
  return s;
}

// The index of the j-th (from 0) value equal to v, in id order; kNone if
// there are not that many.
inline uint nth_equal(device const float* w, uint vocab, float v, uint j, threadgroup uint* counts,
                      threadgroup uint* picked, uint tid) {
  const Span range = chunk_of(vocab, tid);
  uint c = 0;
  for (uint i = range.begin; i < range.end; ++i) {
    c += w[i] == v ? 1u : 0u;
  }
  counts[tid] = c;
  if (tid == 0) {
    *picked = kNone;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint before = 0;
  for (uint t = 0; t < tid; ++t) {
    before += counts[t];
  }
  if (before <= j && j < before + c) {
    uint seen = before;
    for (uint i = range.begin; i < range.end; ++i) {
      if (w[i] == v) {
        if (seen == j) {
          *picked = i;
          break;
        }
        ++seen;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint out = *picked;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return out;
}

// The first index, in id order, whose cumulative weight exceeds u times the
// total; the last weighted index if rounding leaves none.
inline uint walk_in_order(device const float* w, uint vocab, float u, threadgroup float* sums,
                          threadgroup uint* picked, threadgroup uint* partial, uint tid, uint lane, uint sg) {
  const Span range = chunk_of(vocab, tid);
  float s = 0.0f;
  uint last = kNone;
  for (uint i = range.begin; i < range.end; ++i) {
    if (w[i] > 0.0f) {
      s += w[i];
      last = i;
    }
  }
  sums[tid] = s;
  if (tid == 0) {
    *picked = kNone;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Every thread sums the parts in the same order: the same total, and its
  // own part's place in it.
  float total = 0.0f;
  float before = 0.0f;
  float after = 0.0f;
  for (uint t = 0; t < kSampleThreads; ++t) {
    if (t == tid) {
      before = total;
    }
    total += sums[t];
    if (t == tid) {
      after = total;
    }
  }
  const float target = u * total;
  if (before <= target && target < after) {
    float cum = before;
    uint found = last;
    for (uint i = range.begin; i < range.end; ++i) {
      if (w[i] > 0.0f) {
        cum += w[i];
        if (target < cum) {
          found = i;
          break;
        }
      }
    }
    *picked = found;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint out = *picked;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint last_weighted = group_max_u(last == kNone ? 0 : last + 1, partial, lane, sg);
  return out != kNone ? out : (last_weighted == 0 ? kNone : last_weighted - 1);
}

// Whether `mass` reaches target + target_lo (a product and its rounding
// error, as the host's f64 product).
inline bool reaches(float mass, float target, float target_lo) {
  return mass - target >= target_lo;
}

// Top-p over the weights: the smallest set, most likely first (lower id on
// a tie), whose weight reaches top_p of the total; then the token whose
// cumulative weight, in that order, first exceeds u times the set's.
inline uint nucleus_draw(device const float* w, uint vocab, float top_p, float u, threadgroup float* fpartial,
                         threadgroup uint* upartial, threadgroup uint* counts, threadgroup uint* picked, uint tid,
                         uint lane, uint sg) {
  const float total = mass_at_least(w, vocab, 0, fpartial, tid, lane, sg);
  // A nucleus holds at least the top token. The host compares against
  // top_p * total in f64: the product's rounding error goes with it.
  const float product = top_p * total;
  const float target = max(product, 1.17549435e-38f);
  const float target_lo = product == target ? fma(top_p, total, -product) : 0.0f;
  // tau: the smallest weight in the nucleus, the largest with enough mass
  // at or above it.
  uint tau_key = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint probe = tau_key | (1u << uint(bit));
    if (reaches(mass_at_least(w, vocab, probe, fpartial, tid, lane, sg), target, target_lo)) {
      tau_key = probe;
    }
  }
  const float tau = from_key(tau_key);
  const float above = mass_at_least(w, vocab, tau_key + 1, fpartial, tid, lane, sg);
  const uint ties = max(count_equal(w, vocab, tau, upartial, tid, lane, sg), 1u);
  // Of the tokens weighing tau, the first m in id order complete it.
  uint m = clamp(uint(max(ceil((target - above) / tau), 1.0f)), 1u, ties);
  if (m < ties && !reaches(above + float(m) * tau, target, target_lo)) {
    ++m;
  }
  if (m > 1 && reaches(above + float(m - 1) * tau, target, target_lo)) {
    --m;
  }
  const float kept = above + float(m) * tau;
  const float draw_at = u * kept;
  if (!(draw_at < kept)) {
    return nth_equal(w, vocab, tau, m - 1, counts, picked, tid);
  }
  // The drawn token's weight v: the largest with more than draw_at of the
  // nucleus at or above it.
  uint v_key = 0;
  for (int bit = 31; bit >= 0; --bit) {
    const uint probe = v_key | (1u << uint(bit));
    const float m_at = probe <= tau_key ? kept : mass_at_least(w, vocab, probe, fpartial, tid, lane, sg);
    if (m_at > draw_at) {
      v_key = probe;
    }
  }
  const float v = from_key(v_key);
  const float heavier = v_key == tau_key ? above : mass_at_least(w, vocab, v_key + 1, fpartial, tid, lane, sg);
  const uint at_v = v_key == tau_key ? m : count_equal(w, vocab, v, upartial, tid, lane, sg);
  const float place = floor((draw_at - heavier) / v);
  const uint j = place <= 0.0f ? 0 : min(uint(place), at_v - 1);
  return nth_equal(w, vocab, v, j, counts, picked, tid);
}

// ---------------------------------------------------------------------------
// The kernel

// One threadgroup per row. `work` holds the processed row, then its weights.
[[kernel]] void sample_rows(
    device const float* logits [[buffer(0)]],  // [R, vocab]
    device float* work [[buffer(1)]],          // [R, vocab]
    device const SampleParams* params [[buffer(2)]],
    device const TokenEdit* edits [[buffer(3)]],
    device const uint* masks [[buffer(4)]],    // [R, mask_words]
    device uint* out [[buffer(5)]],            // [R, kSampleOutWords]
    constant SampleDims& d [[buffer(6)]],
    uint row [[threadgroup_position_in_grid]],
    uint tid [[thread_position_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float fpartial[kSampleSimds];
  threadgroup uint upartial[kSampleSimds];
  threadgroup float sums[kSampleThreads];
  threadgroup uint counts[kSampleThreads];
  threadgroup uint picked[1];
  const SampleParams p = params[row];
  const uint vocab = d.vocab;
  device const float* raw = logits + row * vocab;
  device float* x = work + row * vocab;
  device const uint* mask = p.mask_row == kNone ? nullptr : masks + p.mask_row * d.mask_words;
  const bool greedy = p.temperature == 0.0f;

  // The processed row: masked, banned, biased and penalised, in the host's
  // order. A plain greedy row reads the raw one.
  device const float* values = raw;
  if (mask != nullptr || p.edits_count > 0 || !greedy) {
    for (uint i = tid; i < vocab; i += kSampleThreads) {
      x[i] = is_allowed(mask, d.mask_words, i) ? clean(raw[i]) : -INFINITY;
    }
    threadgroup_barrier(mem_flags::mem_device);
    // Each token once in a row's edits: no two threads write one value.
    for (uint e = tid; e < p.edits_count; e += kSampleThreads) {
      const TokenEdit edit = edits[p.edits_start + e];
      if (edit.token >= vocab) {
        continue;  // ids come from the request: those past the vocabulary change nothing
      }
      float v = x[edit.token];
      if ((edit.flags & kEditBanned) != 0) {
        v = -INFINITY;
      }
      if ((edit.flags & kEditBias) != 0) {
        v += edit.bias;
      }
      if ((edit.flags & kEditSeen) != 0 && v != -INFINITY) {
        // From the biased raw logit, once however often the token was seen.
        const float r = clean(raw[edit.token]) + edit.bias;
        v = r > 0.0f ? r / p.repetition : r * p.repetition;
      }
      if (edit.count > 0) {
        v -= p.frequency * float(edit.count);
        v -= p.presence;
      }
      x[edit.token] = v;
    }
    threadgroup_barrier(mem_flags::mem_device);
    values = x;
  }

  // The top value and the lowest id holding it.
  uint best_key = 0;
  uint best_index = kNone;
  for (uint i = tid; i < vocab; i += kSampleThreads) {
    const uint k = order_key(clean(values[i]));
    if (k > best_key) {
      best_key = k;
      best_index = i;
    }
  }
  const Best best = group_best(best_key, best_index, upartial, lane, sg);
  const float top = best.index == kNone ? -INFINITY : from_key(best.key);

  uint token = kNone;
  if (greedy || top == INFINITY) {
    // exp(inf - inf) is NaN; an infinite logit takes all the mass anyway.
    token = top > -INFINITY ? best.index : kNone;
  } else if (top > -INFINITY) {
    // Top-k keeps every token at least as likely as the k-th (ties too):
    // a floor on the value.
    float kth = -INFINITY;
    if (p.top_k > 0 && p.top_k < vocab && count_at_least(x, vocab, 0, upartial, tid, lane, sg) >= p.top_k) {
      uint key = 0;
      for (int bit = 31; bit >= 0; --bit) {
        const uint probe = key | (1u << uint(bit));
        if (count_at_least(x, vocab, probe, upartial, tid, lane, sg) >= p.top_k) {
          key = probe;
        }
      }
      kth = from_key(key);
    }
    // Weights relative to the top token, so min-p is a floor on them too.
    const float inv_t = 1.0f / p.temperature;
    for (uint i = tid; i < vocab; i += kSampleThreads) {
      const float v = x[i];
      const float w = exp_nonpositive((v - top) * inv_t);
      x[i] = (v >= kth && w >= p.min_p) ? w : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_device);
    if (p.top_p < 1.0f) {
      token = nucleus_draw(x, vocab, p.top_p, p.uniform, fpartial, upartial, counts, picked, tid, lane, sg);
    } else {
      token = walk_in_order(x, vocab, p.uniform, sums, picked, upartial, tid, lane, sg);
    }
  }

  // Everything masked (all -inf or NaN): the most likely token the grammar
  // allows, else the raw argmax, else token 0.
  if (token == kNone && mask != nullptr) {
    uint k = 0;
    uint at = kNone;
    for (uint i = tid; i < vocab; i += kSampleThreads) {
      const uint key = order_key(clean(raw[i]));
      if (is_allowed(mask, d.mask_words, i) && key > k) {
        k = key;
        at = i;
      }
    }
    token = group_best(k, at, upartial, lane, sg).index;
  }
  uint raw_key = 0;
  uint raw_index = kNone;
  if (token == kNone || p.top_logprobs != kNone) {
    for (uint i = tid; i < vocab; i += kSampleThreads) {
      const uint k = order_key(clean(raw[i]));
      if (k > raw_key) {
        raw_key = k;
        raw_index = i;
      }
    }
    const Best b = group_best(raw_key, raw_index, upartial, lane, sg);
    raw_key = b.key;
    raw_index = b.index;
  }
  if (token == kNone) {
    token = raw_index != kNone && from_key(raw_key) > -INFINITY ? raw_index : 0;
  }

  device uint* o = out + row * kSampleOutWords;
  if (tid == 0) {
    o[0] = token;
    o[1] = 0;
  }
  if (p.top_logprobs == kNone) {
    return;  // uniform: the whole threadgroup
  }
  // The raw row's log-softmax, from its max and exp-sum (the host takes the
  // log in f64), and its top tokens: value descending, lower id first.
  const float raw_max = from_key(raw_key);
  float s = 0.0f;
  for (uint i = tid; i < vocab; i += kSampleThreads) {
    s += exp_nonpositive(clean(raw[i]) - raw_max);
  }
  const float exp_sum = group_sum(s, fpartial, lane, sg);
  const uint n = min(min(p.top_logprobs, kMaxTopLogprobs), vocab);
  uint prev_key = kNone;
  uint prev_index = kNone;
  for (uint r = 0; r < n; ++r) {
    uint k = 0;
    uint at = kNone;
    for (uint i = tid; i < vocab; i += kSampleThreads) {
      const uint key = order_key(clean(raw[i]));
      const bool after_prev = key < prev_key || (key == prev_key && (prev_index == kNone || i > prev_index));
      if (after_prev && key > k) {
        k = key;
        at = i;
      }
    }
    const Best b = group_best(k, at, upartial, lane, sg);
    prev_key = b.key;
    prev_index = b.index;
    if (tid == 0) {
      o[5 + 2 * r] = b.index;
      o[6 + 2 * r] = as_type<uint>(raw[b.index]);  // as it is, NaN included
    }
  }
  if (tid == 0) {
    o[1] = n;
    o[2] = as_type<uint>(raw_max);
    o[3] = as_type<uint>(exp_sum);
    o[4] = as_type<uint>(raw[token]);
  }
}
