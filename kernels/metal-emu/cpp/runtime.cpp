// The emulator's execution model: one dispatch runs its threadgroups one at
// a time, in a shuffled order; each kernel thread of a threadgroup is a
// fiber with its own stack. A fiber runs until it reaches a barrier or a
// SIMD-group function, then waits there. When every lane of a SIMD group
// (32 threads) waits at the same SIMD call, the scheduler computes the
// collective and releases them; when every thread of the threadgroup waits
// at the same barrier, it releases them all. Anything else (lanes of one
// SIMD group at different calls, or some returned while others wait) is an
// error, which is how a SIMD function in divergent code shows.
//
// Which fiber runs next is the lowest-ranked runnable one under a
// permutation drawn from the dispatch's order seed, so one SIMD group runs
// as far ahead of the others as the synchronisation allows: a missing
// barrier then reads memory its producer has not written yet (NaN poison)
// or has already overwritten, and the result changes with the order.
//
// Device buffers are exact-size allocations ending at an inaccessible page
// (buffer_alloc), so reading or writing past one's end faults at once.

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "invoke.h"

void tvm_register_decode();
void tvm_register_prefill();
void tvm_register_cache();
void tvm_register_model();
void tvm_register_sample();

namespace tvm {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr uint32_t kSimdWidth = 32;
constexpr uint32_t kMaxThreads = 1024;

// ---------------------------------------------------------------------------
// Context switch: x86-64 saves the callee-saved registers and the FP control
// words on the stack and swaps stack pointers; elsewhere ucontext (slower,
// it makes a system call per switch).

#if defined(__x86_64__)
extern "C" void tvm_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl tvm_switch
  .type tvm_switch, @function
tvm_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tvm_switch, .-tvm_switch
)");

struct Context {
  void* sp = nullptr;
};
void switch_to(Context& from, Context& to) { tvm_switch(&from.sp, to.sp); }
void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  auto* words = reinterpret_cast<uint64_t*>(top);
  words[-2] = reinterpret_cast<uint64_t>(entry);  // where `ret` goes; rsp = top - 8 after it
  for (int i = 3; i <= 8; ++i) {
    words[-i] = 0;  // rbp, rbx, r12-r15
  }
  uint32_t control[2];
  asm volatile("stmxcsr %0" : "=m"(control[0]));
  asm volatile("fnstcw %0" : "=m"(control[1]));
  std::memcpy(&words[-9], control, 8);
  c.sp = &words[-9];
}
#else
#include <ucontext.h>
struct Context {
  ucontext_t uc;
};
void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
void start_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// ---------------------------------------------------------------------------
// Registry

struct KernelEntry {
  std::string function;
  Invoker invoker;
};

std::map<std::string, KernelEntry>& registry() {
  static std::map<std::string, KernelEntry> kernels;
  return kernels;
}

// ---------------------------------------------------------------------------
// Fibers and the scheduler

enum class State : uint8_t { Ready, Waiting, Done };

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  uint32_t tid = 0;
  State state = State::Ready;
  Op op = Op::Barrier;
  Type type = Type::Bool;
  uint64_t value = 0;
  uint32_t lane_arg = 0;
  int line = 0;
  uint64_t result = 0;
};

struct Run {
  Invoker invoker = nullptr;
  ThreadCtx base{};
  std::vector<Fiber> fibers;
  std::vector<uint32_t> rank_to_fiber;
  std::vector<uint32_t> fiber_rank;
  std::vector<uint64_t> ready;  // bit per rank
  // Per SIMD group: lanes stopped (waiting or returned) since its last
  // release, so the group is examined once all of them have stopped rather
  // than at every lane's stop.
  std::vector<uint32_t> stopped;
  std::vector<void*> seen_threadgroup_memory;
  Context scheduler;
  Fiber* current = nullptr;
  std::string error;
  bool failed = false;
};

Run* g_run = nullptr;
std::mutex g_lock;  // threadgroup memory is static: one dispatch at a time

[[noreturn]] void back_to_scheduler_forever(Fiber* f) {
  switch_to(f->ctx, g_run->scheduler);
  __builtin_trap();  // a finished or failed fiber is never resumed
}

void yield_from(Run& r, Fiber* f);

void fiber_main() {
  Run* run = g_run;
  Fiber* f = run->current;
  ThreadCtx c = run->base;
  c.tid = f->tid;
  run->invoker(c);
  f->state = State::Done;
  yield_from(*run, f);
  __builtin_trap();  // a finished fiber is never resumed
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Seed 0: natural order; 1: reversed; others: a random permutation.
std::vector<uint32_t> permutation(uint32_t n, uint64_t seed) {
  std::vector<uint32_t> p(n);
  for (uint32_t i = 0; i < n; ++i) p[i] = i;
  if (seed == 1) {
    std::reverse(p.begin(), p.end());
  } else if (seed > 1) {
    uint64_t s = seed;
    for (uint32_t i = n; i > 1; --i) std::swap(p[i - 1], p[splitmix(s) % i]);
  }
  return p;
}

void set_ready(Run& r, uint32_t fiber) {
  const uint32_t rank = r.fiber_rank[fiber];
  r.ready[rank / 64] |= uint64_t(1) << (rank % 64);
}

int first_ready(const Run& r) {
  for (size_t w = 0; w < r.ready.size(); ++w) {
    if (r.ready[w] != 0) return int(w * 64 + __builtin_ctzll(r.ready[w]));
  }
  return -1;
}

const char* op_name(Op op) {
  switch (op) {
    case Op::Sum: return "simd_sum";
    case Op::Max: return "simd_max";
    case Op::Min: return "simd_min";
    case Op::Shuffle: return "simd_shuffle";
    case Op::Any: return "simd_any";
    case Op::All: return "simd_all";
    case Op::Barrier: return "threadgroup_barrier";
  }
  return "?";
}

void fail_run(Run& r, const std::string& msg) {
  if (!r.failed) {
    r.failed = true;
    r.error = msg;
  }
}

std::string describe_simdgroup(const Run& r, uint32_t first, uint32_t last) {
  std::string s;
  char buf[128];
  for (uint32_t t = first; t < last; ++t) {
    const Fiber& f = r.fibers[t];
    if (f.state == State::Done) {
      snprintf(buf, sizeof buf, " lane %u returned;", t - first);
    } else {
      snprintf(buf, sizeof buf, " lane %u at %s (line %d);", t - first, op_name(f.op), f.line);
    }
    s += buf;
  }
  return s;
}

float as_f32(uint64_t v) { return unpack<float>(v); }

// Lanes [first, last) all wait at the same collective: compute it.
void resolve(Run& r, uint32_t first, uint32_t last) {
  const uint32_t n = last - first;
  const Fiber& lead = r.fibers[first];
  uint64_t values[kSimdWidth];
  for (uint32_t i = 0; i < n; ++i) values[i] = r.fibers[first + i].value;
  uint64_t out = 0;
  switch (lead.op) {
    case Op::Shuffle:
      for (uint32_t i = 0; i < n; ++i) {
        Fiber& f = r.fibers[first + i];
        if (f.lane_arg >= n) {
          fail_run(r, "simd_shuffle from lane " + std::to_string(f.lane_arg) + ", past the SIMD group (line " +
                          std::to_string(f.line) + ")");
          return;
        }
        f.result = values[f.lane_arg];
      }
      return;
    case Op::Any:
    case Op::All: {
      bool acc = lead.op == Op::All;
      for (uint32_t i = 0; i < n; ++i) acc = lead.op == Op::All ? (acc && values[i]) : (acc || values[i]);
      out = acc;
      break;
    }
    default:
      if (lead.type == Type::F32) {
        // A fixed tree over the lanes: the order of the sums does not
        // depend on the scheduling.
        float v[kSimdWidth];
        const float id = lead.op == Op::Sum ? 0.0f : as_f32(values[0]);
        for (uint32_t i = 0; i < kSimdWidth; ++i) v[i] = i < n ? as_f32(values[i]) : id;
        for (uint32_t s = kSimdWidth / 2; s >= 1; s /= 2) {
          for (uint32_t i = 0; i < s; ++i) {
            const float a = v[i], b = v[i + s];
            v[i] = lead.op == Op::Sum ? a + b : lead.op == Op::Max ? metal::max(a, b) : metal::min(a, b);
          }
        }
        out = pack(v[0]);
      } else {
        const bool is_signed = lead.type == Type::I32;
        int64_t acc = is_signed ? int64_t(int32_t(values[0])) : int64_t(uint32_t(values[0]));
        for (uint32_t i = 1; i < n; ++i) {
          const int64_t x = is_signed ? int64_t(int32_t(values[i])) : int64_t(uint32_t(values[i]));
          acc = lead.op == Op::Sum ? acc + x : lead.op == Op::Max ? std::max(acc, x) : std::min(acc, x);
        }
        out = uint64_t(uint32_t(acc));
      }
  }
  for (uint32_t i = 0; i < n; ++i) r.fibers[first + i].result = out;
}

// After a lane of SIMD group `sg` stopped: if the whole group has stopped,
// release it from a common collective, or report how it diverged.
void settle_simdgroup(Run& r, uint32_t sg, uint32_t num_threads) {
  const uint32_t first = sg * kSimdWidth, last = std::min(first + kSimdWidth, num_threads);
  bool any_collective = false, all_same = true;
  for (uint32_t t = first; t < last; ++t) {
    const Fiber& f = r.fibers[t];
    if (f.state == State::Ready) return;  // not all there yet
    if (f.state == State::Waiting && f.op != Op::Barrier) any_collective = true;
    const Fiber& l = r.fibers[first];
    if (f.state != l.state || (f.state == State::Waiting && (f.op != l.op || f.line != l.line))) all_same = false;
  }
  if (!any_collective) return;  // barriers and returns: settled by the threadgroup
  if (!all_same) {
    fail_run(r, "SIMD group " + std::to_string(sg) + " diverged at a SIMD function:" +
                    describe_simdgroup(r, first, last));
    return;
  }
  resolve(r, first, last);
  r.stopped[sg] = 0;
  for (uint32_t t = first; t < last; ++t) {
    r.fibers[t].state = State::Ready;
    set_ready(r, t);
  }
}

// No fiber can run: release a barrier that every thread reached, finish,
// or report the deadlock.
bool settle_threadgroup(Run& r) {
  bool all_done = true, any_done = false;
  int line = -1;
  for (const Fiber& f : r.fibers) {
    if (f.state == State::Done) {
      any_done = true;
      continue;
    }
    all_done = false;
    if (f.op != Op::Barrier) {
      fail_run(r, "a SIMD function waits for lanes that never come (line " + std::to_string(f.line) + ")");
      return false;
    }
    if (line >= 0 && f.line != line) {
      fail_run(r, "threads wait at different barriers (lines " + std::to_string(line) + " and " +
                      std::to_string(f.line) + ")");
      return false;
    }
    line = f.line;
  }
  if (all_done) return false;
  if (any_done) {
    fail_run(r, "a barrier (line " + std::to_string(line) + ") waits for threads that have returned");
    return false;
  }
  std::fill(r.stopped.begin(), r.stopped.end(), 0);
  for (uint32_t t = 0; t < r.fibers.size(); ++t) {
    r.fibers[t].state = State::Ready;
    set_ready(r, t);
  }
  return true;
}

struct Stacks {
  std::vector<char*> stacks;
  char* get(size_t i) {
    while (stacks.size() <= i) {
      const size_t page = size_t(sysconf(_SC_PAGESIZE));
      void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) return nullptr;
      mprotect(m, page, PROT_NONE);  // a stack overflow faults
      stacks.push_back(static_cast<char*>(m) + page);
    }
    return stacks[i];
  }
};
Stacks g_stacks;

// Fiber `f` has just stopped (waits at a collective or a barrier, or has
// returned): settles its SIMD group once all its lanes have stopped, then
// switches straight to the next runnable fiber (the lowest-ranked, as the
// scheduler would pick), or back to the scheduler when none can run or the
// run failed. Going fiber to fiber halves the switches of a collective.
void yield_from(Run& r, Fiber* f) {
  const uint32_t num_threads = uint32_t(r.fibers.size());
  const uint32_t sg = f->tid / kSimdWidth;
  const uint32_t lanes = std::min(kSimdWidth, num_threads - sg * kSimdWidth);
  if (++r.stopped[sg] == lanes) {
    settle_simdgroup(r, sg, num_threads);
  }
  const int rank = r.failed ? -1 : first_ready(r);
  if (rank < 0) {
    switch_to(f->ctx, r.scheduler);
    return;
  }
  r.ready[rank / 64] &= ~(uint64_t(1) << (rank % 64));
  Fiber* next = &r.fibers[r.rank_to_fiber[rank]];
  r.current = next;
  if (next != f) {
    switch_to(f->ctx, next->ctx);
  }
}

void run_threadgroup(Run& r, uint3 tg, uint32_t num_threads) {
  r.base.tg = tg;
  r.seen_threadgroup_memory.clear();
  std::fill(r.ready.begin(), r.ready.end(), 0);
  r.stopped.assign((num_threads + kSimdWidth - 1) / kSimdWidth, 0);
  for (uint32_t t = 0; t < num_threads; ++t) {
    Fiber& f = r.fibers[t];
    f.state = State::Ready;
    f.tid = t;
    start_context(f.ctx, f.stack, kStackBytes, fiber_main);
    set_ready(r, t);
  }
  for (;;) {
    const int rank = first_ready(r);
    if (rank < 0) {
      if (!settle_threadgroup(r)) return;
      continue;
    }
    r.ready[rank / 64] &= ~(uint64_t(1) << (rank % 64));
    Fiber& f = r.fibers[r.rank_to_fiber[rank]];
    r.current = &f;
    // Back here when no fiber can run (every stop was settled on the way)
    // or the run failed.
    switch_to(r.scheduler, f.ctx);
    if (r.failed) return;
  }
}

// ---------------------------------------------------------------------------
// Faults: a kernel that leaves its buffers faults on a guard page.

struct sigaction g_previous_segv;
struct sigaction g_previous_bus;

// ---------------------------------------------------------------------------
// Traffic: the bytes a dispatch touches in device memory, each once (as if
// a cache held everything one dispatch touches). While a dispatch runs with
// counting on, its device buffers are mapped with no access; the first
// touch of each page faults, is counted (the page's bytes inside the
// buffer) and opens the page. Page granularity: a buffer's partly touched
// page counts whole, a small over-count next to weights and KV.

struct Tracked {
  char* start;
  char* end;
};
std::vector<Tracked> g_tracked;
uint64_t g_traffic = 0;
bool g_counting = false;

size_t page_size() {
  static const size_t size = size_t(sysconf(_SC_PAGESIZE));
  return size;
}

char* page_floor(char* p) { return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(p) & ~(page_size() - 1)); }

// Opens the tracked page holding `addr` and counts it; false when `addr`
// is in no tracked buffer.
bool count_touch(char* addr) {
  const Tracked* widest = nullptr;
  for (const Tracked& t : g_tracked) {
    if (addr >= t.start && addr < t.end && (widest == nullptr || t.start < widest->start)) widest = &t;
  }
  if (widest == nullptr) return false;
  char* page = page_floor(addr);
  mprotect(page, page_size(), PROT_READ | PROT_WRITE);
  char* lo = std::max(page, widest->start);
  char* hi = std::min(page + page_size(), widest->end);
  g_traffic += uint64_t(hi - lo);
  return true;
}

void protect_tracked(int prot) {
  for (const Tracked& t : g_tracked) {
    char* lo = page_floor(t.start);
    char* hi = page_floor(t.end + page_size() - 1);
    if (hi > lo) mprotect(lo, size_t(hi - lo), prot);
  }
}

void on_fault(int sig, siginfo_t* info, void*) {
  if (g_counting && count_touch(static_cast<char*>(info->si_addr))) return;
  char msg[200];
  const int len = snprintf(msg, sizeof msg,
                           "\nmetal emulator: a kernel thread touched %p, outside every buffer it was given "
                           "(past a buffer's end, or a stack overflow)\n",
                           info->si_addr);
  if (len > 0) (void)!write(2, msg, size_t(len));
  sigaction(SIGSEGV, &g_previous_segv, nullptr);
  sigaction(SIGBUS, &g_previous_bus, nullptr);
  raise(sig);
}

}  // namespace

// ---------------------------------------------------------------------------
// What the kernels call (msl.h, invoke.h)

uint64_t sync_point(Op op, Type type, uint64_t value, uint32_t lane_arg, int line) {
  Run& r = *g_run;
  Fiber* f = r.current;
  f->state = State::Waiting;
  f->op = op;
  f->type = type;
  f->value = value;
  f->lane_arg = lane_arg;
  f->line = line;
  yield_from(r, f);
  return f->result;
}

void threadgroup_memory(void* p, size_t bytes) {
  Run& r = *g_run;
  if (std::find(r.seen_threadgroup_memory.begin(), r.seen_threadgroup_memory.end(), p) !=
      r.seen_threadgroup_memory.end()) {
    return;
  }
  r.seen_threadgroup_memory.push_back(p);
  std::memset(p, 0xff, bytes);
}

void fail(const char* what, uint32_t index) {
  Run& r = *g_run;
  fail_run(r, std::string(what) + " " + std::to_string(index));
  back_to_scheduler_forever(r.current);
}

void add_kernel(const char* host_name, const char* function, Invoker invoker) {
  registry()[host_name] = KernelEntry{function, invoker};
}

}  // namespace tvm

// ---------------------------------------------------------------------------
// The C interface (src/lib.rs)

namespace {
void register_all() {
  static std::once_flag once;
  std::call_once(once, [] {
    tvm_register_decode();
    tvm_register_prefill();
    tvm_register_cache();
    tvm_register_model();
    tvm_register_sample();
  });
}
void set_error(char* err, size_t len, const std::string& msg) {
  if (len == 0) return;
  const size_t n = std::min(len - 1, msg.size());
  std::memcpy(err, msg.data(), n);
  err[n] = 0;
}
}  // namespace

extern "C" {

// The template function kernel `host_name` instantiates, or null.
const char* tvm_kernel_function(const char* host_name) {
  register_all();
  auto it = tvm::registry().find(host_name);
  return it == tvm::registry().end() ? nullptr : it->second.function.c_str();
}

// `len` bytes, all 0xff (NaN in every float type), ending right before an
// inaccessible page; aligned to 4 bytes when `len` is. Null on failure.
void* tvm_buffer_alloc(size_t len) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t body = (len + page - 1) / page * page;
  void* m = mmap(nullptr, body + 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  char* base = static_cast<char*>(m);
  mprotect(base, page, PROT_NONE);
  mprotect(base + page + body, page, PROT_NONE);
  char* start = base + page + body - len;
  std::memset(base + page, 0xff, body);
  return start;
}

void tvm_buffer_free(void* p, size_t len) {
  if (p == nullptr) return;
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  const size_t body = (len + page - 1) / page * page;
  char* end = static_cast<char*>(p) + len;
  munmap(end - body - page, body + 2 * page);
}

// Runs kernel `host_name` over `groups` threadgroups of `threads` threads,
// its parameters given by `specs` (one per parameter, from the source) and
// the host's `bindings` (by buffer index). Returns 0, or -1 with a message.
// With `traffic` non-null, counts the bytes of the device buffers
// (bindings whose `is_device` flag is set) the dispatch touches into it.
int tvm_dispatch(const char* host_name, const tvm::ArgSpec* specs, size_t num_specs, const tvm::Binding* bindings,
                 size_t num_bindings, const uint32_t groups[3], const uint32_t threads[3], uint64_t order_seed,
                 const uint8_t* is_device, uint64_t* traffic, char* err, size_t err_len) {
  register_all();
  auto it = tvm::registry().find(host_name);
  if (it == tvm::registry().end()) {
    set_error(err, err_len, std::string("no kernel named ") + host_name);
    return -1;
  }
  const uint64_t n64 = uint64_t(threads[0]) * threads[1] * threads[2];
  if (n64 == 0 || n64 > tvm::kMaxThreads || threads[1] != 1 || threads[2] != 1) {
    set_error(err, err_len, "threads per threadgroup must be 1 to 1024, in x only");
    return -1;
  }
  const uint32_t num_threads = uint32_t(n64);
  std::lock_guard<std::mutex> guard(tvm::g_lock);

  tvm::Run run;
  run.invoker = it->second.invoker;
  run.base.threads = {threads[0], threads[1], threads[2]};
  run.base.bindings = bindings;
  run.base.num_bindings = num_bindings;
  run.base.specs = specs;
  run.base.num_specs = num_specs;
  run.fibers.resize(num_threads);
  for (uint32_t t = 0; t < num_threads; ++t) {
    run.fibers[t].stack = tvm::g_stacks.get(t);
    if (run.fibers[t].stack == nullptr) {
      set_error(err, err_len, "out of memory for fiber stacks");
      return -1;
    }
  }
  run.ready.assign((num_threads + 63) / 64, 0);
  const std::vector<uint32_t> lanes = tvm::permutation(num_threads, order_seed);
  run.rank_to_fiber = lanes;
  run.fiber_rank.resize(num_threads);
  for (uint32_t rank = 0; rank < num_threads; ++rank) run.fiber_rank[lanes[rank]] = rank;

  const uint64_t total = uint64_t(groups[0]) * groups[1] * groups[2];
  if (total > (uint64_t(1) << 31)) {
    set_error(err, err_len, "grid too large for the emulator");
    return -1;
  }
  const std::vector<uint32_t> order = tvm::permutation(uint32_t(total), order_seed * 7919 + 3);

  struct sigaction on_fault {};
  on_fault.sa_sigaction = tvm::on_fault;
  on_fault.sa_flags = SA_SIGINFO;
  sigemptyset(&on_fault.sa_mask);
  sigaction(SIGSEGV, &on_fault, &tvm::g_previous_segv);
  sigaction(SIGBUS, &on_fault, &tvm::g_previous_bus);
  tvm::g_run = &run;
  if (traffic != nullptr) {
    tvm::g_tracked.clear();
    for (size_t b = 0; b < num_bindings; ++b) {
      if (is_device[b] != 0 && bindings[b].ptr != nullptr && bindings[b].len > 0) {
        char* start = static_cast<char*>(bindings[b].ptr);
        tvm::g_tracked.push_back({start, start + bindings[b].len});
      }
    }
    tvm::g_traffic = 0;
    tvm::g_counting = true;
    tvm::protect_tracked(PROT_NONE);
  }
  for (uint32_t i = 0; i < total && !run.failed; ++i) {
    const uint32_t g = order[i];
    const uint3 tg = {g % groups[0], (g / groups[0]) % groups[1], g / (groups[0] * groups[1])};
    tvm::run_threadgroup(run, tg, num_threads);
  }
  if (traffic != nullptr) {
    tvm::protect_tracked(PROT_READ | PROT_WRITE);
    tvm::g_counting = false;
    *traffic = tvm::g_traffic;
  }
  tvm::g_run = nullptr;
  sigaction(SIGSEGV, &tvm::g_previous_segv, nullptr);
  sigaction(SIGBUS, &tvm::g_previous_bus, nullptr);
  if (run.failed) {
    set_error(err, err_len, run.error);
    return -1;
  }
  return 0;
}

}  // extern "C"
