// The HybridAdam / AdamW step for CPU-resident leaves, as an XLA FFI custom call.
//
// One call updates every leaf it is given: for each leaf it reads the gradient,
// both moments and (when needed) the parameter once, and writes the moments in
// place (aliased by the caller) plus either the update (Optax contract) or the
// new parameter in place (fused apply). Float32 math whatever the storage
// dtype; bfloat16 and float16 leaves with float32 or same-dtype moments. Work is
// split into chunks spread over XLA's intra-op thread pool.
//
// Each chunk runs through one function, compiled once per instruction set
// (AVX-512, AVX2, baseline) from one body; the library picks one when it loads
// (see "Instruction sets" below), so the same binary runs on any CPU of its
// architecture and uses the widest vectors the CPU has.
//
// The rule is the one in reference.py, which the tests compare this against.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace ffi = xla::ffi;

namespace {

// Everything the per-chunk body calls is force-inlined into it, so that each
// instruction-set copy of the body (below) compiles all of its loops for that
// instruction set: a function left out of line would be compiled once, for the
// baseline, and called from every copy.
#define OPTAX_HYBRID_BODY inline __attribute__((always_inline))

// ---------------------------------------------------------------------------
// Storage types and their conversions to and from float.

struct BF16 {
  uint16_t bits;
};
// IEEE half precision: _Float16; __fp16 on Arm, where GCC's C++ has no
// _Float16 before GCC 13 (both convert to and from float as IEEE says).
#if defined(__aarch64__) || defined(__arm__)
using Half = __fp16;
#else
using Half = _Float16;
#endif
struct F16 {
  Half value;
};

OPTAX_HYBRID_BODY float to_f32(float x) { return x; }
OPTAX_HYBRID_BODY float to_f32(BF16 x) {
  uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
OPTAX_HYBRID_BODY float to_f32(F16 x) { return static_cast<float>(x.value); }

template <typename T>
OPTAX_HYBRID_BODY T from_f32(float f);
template <>
OPTAX_HYBRID_BODY float from_f32<float>(float f) { return f; }
template <>
OPTAX_HYBRID_BODY BF16 from_f32<BF16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{static_cast<uint16_t>((u >> 16) | 0x40u)};  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return BF16{static_cast<uint16_t>(u >> 16)};
}
template <>
OPTAX_HYBRID_BODY F16 from_f32<F16>(float f) { return F16{static_cast<Half>(f)}; }

struct Scalars {
  float lr, b1, b2, eps, wd, bc1, bc2_sqrt;
  bool step_ok;
};

// ---------------------------------------------------------------------------
// One contiguous range of one leaf. T: gradient/param storage, S: moment storage,
// U: storage of the first output (update, or new param when kWriteParams).

template <typename T, typename S, typename U, bool kDecoupled, bool kL2, bool kWriteParams>
OPTAX_HYBRID_BODY void step_range(const T* __restrict g, S* __restrict m, S* __restrict v, const T* __restrict p,
                U* __restrict out, int64_t begin, int64_t end, const Scalars& s) {
  const float b1 = s.b1, one_minus_b1 = 1.0f - s.b1;
  const float b2 = s.b2, one_minus_b2 = 1.0f - s.b2;
  const float bc2_sqrt = s.bc2_sqrt;
  const float eps = s.eps;
  const float step = -(s.lr / s.bc1);
  const float wd = s.wd;
  const float lr_wd = s.lr * s.wd;
  for (int64_t i = begin; i < end; ++i) {
    float gi = to_f32(g[i]);
    float pi = 0.0f;
    if constexpr (kDecoupled || kL2 || kWriteParams) pi = to_f32(p[i]);
    if constexpr (kL2) gi = gi + wd * pi;
    const float mi = b1 * to_f32(m[i]) + one_minus_b1 * gi;
    const float vi = b2 * to_f32(v[i]) + one_minus_b2 * (gi * gi);
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    float ui = step * (mi / denom);
    if constexpr (kDecoupled) ui = ui - lr_wd * pi;
    m[i] = from_f32<S>(mi);
    v[i] = from_f32<S>(vi);
    if constexpr (kWriteParams) {
      out[i] = from_f32<U>(pi + ui);
    } else {
      out[i] = from_f32<U>(ui);
    }
  }
}

// A skipped step (non-finite gradients): moments stay, the update is zero and
// the param is rewritten unchanged.
template <typename T, typename U, bool kWriteParams>
OPTAX_HYBRID_BODY void skip_range(const T* __restrict p, U* __restrict out, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    if constexpr (kWriteParams) {
      out[i] = from_f32<U>(to_f32(p[i]));
    } else {
      out[i] = from_f32<U>(0.0f);
    }
  }
}

enum class Kind { kF32, kBF16, kF16, kOther };

Kind kind_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return Kind::kF32;
    case ffi::DataType::BF16:
      return Kind::kBF16;
    case ffi::DataType::F16:
      return Kind::kF16;
    default:
      return Kind::kOther;
  }
}

struct Leaf {
  void* g;
  void* m;
  void* v;
  void* p;  // nullptr when the leaf needs no param
  void* out;
  int64_t n;
  Kind t, s, u;
  bool decay;
};

template <typename T, typename S, typename U, bool kWriteParams>
OPTAX_HYBRID_BODY void run_leaf_typed(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw) {
  auto* g = static_cast<const T*>(leaf.g);
  auto* m = static_cast<S*>(leaf.m);
  auto* v = static_cast<S*>(leaf.v);
  auto* p = static_cast<const T*>(leaf.p);
  auto* out = static_cast<U*>(leaf.out);
  if (!s.step_ok) {
    skip_range<T, U, kWriteParams>(p, out, begin, end);
  } else if (leaf.decay && adamw) {
    step_range<T, S, U, true, false, kWriteParams>(g, m, v, p, out, begin, end, s);
  } else if (leaf.decay) {
    step_range<T, S, U, false, true, kWriteParams>(g, m, v, p, out, begin, end, s);
  } else {
    step_range<T, S, U, false, false, kWriteParams>(g, m, v, p, out, begin, end, s);
  }
}

// The per-chunk body: one range of one leaf, any supported dtype combination
// and rule. Every loop of the kernel lives below this function, so that each
// instruction-set copy (run_chunk_*) gets all of them.
// Supported combinations: T in {f32, bf16, f16}; S == f32 or S == T; U == f32 if
// S == f32 else T (the dtype optax returns); U == T when writing params.
template <bool kWriteParams>
OPTAX_HYBRID_BODY bool run_leaf(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw) {
#define OPTAX_HYBRID_CASE(KT, KS, KU, T, S, U)                                  \
  if (leaf.t == KT && leaf.s == KS && leaf.u == KU) {                          \
    run_leaf_typed<T, S, U, kWriteParams>(leaf, begin, end, s, adamw);         \
    return true;                                                               \
  }
  if constexpr (kWriteParams) {
    OPTAX_HYBRID_CASE(Kind::kF32, Kind::kF32, Kind::kF32, float, float, float)
    OPTAX_HYBRID_CASE(Kind::kBF16, Kind::kF32, Kind::kBF16, BF16, float, BF16)
    OPTAX_HYBRID_CASE(Kind::kBF16, Kind::kBF16, Kind::kBF16, BF16, BF16, BF16)
    OPTAX_HYBRID_CASE(Kind::kF16, Kind::kF32, Kind::kF16, F16, float, F16)
    OPTAX_HYBRID_CASE(Kind::kF16, Kind::kF16, Kind::kF16, F16, F16, F16)
  } else {
    OPTAX_HYBRID_CASE(Kind::kF32, Kind::kF32, Kind::kF32, float, float, float)
    OPTAX_HYBRID_CASE(Kind::kBF16, Kind::kF32, Kind::kF32, BF16, float, float)
    OPTAX_HYBRID_CASE(Kind::kBF16, Kind::kBF16, Kind::kBF16, BF16, BF16, BF16)
    OPTAX_HYBRID_CASE(Kind::kF16, Kind::kF32, Kind::kF32, F16, float, float)
    OPTAX_HYBRID_CASE(Kind::kF16, Kind::kF16, Kind::kF16, F16, F16, F16)
  }
#undef OPTAX_HYBRID_CASE
  return false;
}

// ---------------------------------------------------------------------------
// Instruction sets. The chunk body is compiled once per instruction set, each
// copy a function with its own `target` attribute, and one copy is chosen when
// the library loads: the widest this CPU runs, or the one named by the
// environment variable OPTAX_HYBRID_NATIVE_ISA (auto, avx512, avx2, baseline).
// The rest of the library is built for the architecture's baseline (setup.py
// passes no -march), so a wheel built on one machine runs on any other.

using ChunkFn = bool (*)(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw,
                         bool write_params);

#define OPTAX_HYBRID_CHUNK_FOR_ISA(NAME, TARGET_ATTRIBUTE)                                          \
  TARGET_ATTRIBUTE bool NAME(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw, \
                             bool write_params) {                                                  \
    return write_params ? run_leaf<true>(leaf, begin, end, s, adamw)                               \
                        : run_leaf<false>(leaf, begin, end, s, adamw);                             \
  }

OPTAX_HYBRID_CHUNK_FOR_ISA(run_chunk_baseline, )

struct IsaVariant {
  const char* name;
  ChunkFn run_chunk;
  bool (*cpu_runs_it)();
};

#if defined(__x86_64__) || defined(__i386__)
// F16C (float16 conversions) and FMA come with every AVX2 and AVX-512 CPU;
// they are listed so that the compiler may use them.
OPTAX_HYBRID_CHUNK_FOR_ISA(run_chunk_avx2, __attribute__((target("avx2,fma,f16c"))))
OPTAX_HYBRID_CHUNK_FOR_ISA(run_chunk_avx512,
                           __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))))

// CPUID leaf 1 directly: __builtin_cpu_supports("f16c") is not in every compiler (Clang 14 lacks it).
bool cpu_has_f16c() {
  unsigned eax, ebx, ecx, edx;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}
bool cpu_runs_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
}
bool cpu_runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && cpu_runs_avx2();
}
#endif
bool cpu_runs_baseline() { return true; }

// Widest first: "auto" takes the first one the CPU runs.
constexpr IsaVariant kIsaVariants[] = {
#if defined(__x86_64__) || defined(__i386__)
    {"avx512", run_chunk_avx512, cpu_runs_avx512},
    {"avx2", run_chunk_avx2, cpu_runs_avx2},
#endif
    {"baseline", run_chunk_baseline, cpu_runs_baseline},
};

constexpr char kIsaVariable[] = "OPTAX_HYBRID_NATIVE_ISA";

struct IsaChoice {
  const IsaVariant* variant = nullptr;  // nullptr: the variable names no variant this CPU runs
  char cpu_runs[64] = "";               // the variants this CPU runs, widest first, space-separated
  char problem[512] = "";
};

IsaChoice choose_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // this may run before libgcc's own initializer
#endif
  IsaChoice choice;
  char names[64] = "";  // every variant of this build, for the message
  for (const IsaVariant& v : kIsaVariants) {
    std::snprintf(names + std::strlen(names), sizeof names - std::strlen(names), "%s%s", *names ? ", " : "",
                  v.name);
    if (v.cpu_runs_it()) {
      std::snprintf(choice.cpu_runs + std::strlen(choice.cpu_runs),
                    sizeof choice.cpu_runs - std::strlen(choice.cpu_runs), "%s%s", *choice.cpu_runs ? " " : "",
                    v.name);
    }
  }
  const char* requested = std::getenv(kIsaVariable);
  const bool automatic = requested == nullptr || *requested == '\0' || std::strcmp(requested, "auto") == 0;
  for (const IsaVariant& v : kIsaVariants) {
    if (automatic ? v.cpu_runs_it() : std::strcmp(requested, v.name) == 0) {
      if (v.cpu_runs_it()) {
        choice.variant = &v;
      } else {
        std::snprintf(choice.problem, sizeof choice.problem,
                      "%s=%s, but this CPU cannot run that instruction set (it runs: %s); unset %s or set it "
                      "to auto or to one of those",
                      kIsaVariable, requested, choice.cpu_runs, kIsaVariable);
      }
      return choice;
    }
  }
  std::snprintf(choice.problem, sizeof choice.problem,
                "%s=%s is not an instruction set of this build; accepted values: auto, %s", kIsaVariable,
                requested, names);
  return choice;
}

// Chosen once, when the library is loaded.
const IsaChoice kIsa = choose_isa();

// ---------------------------------------------------------------------------
// Work sharing: chunks claimed from an atomic counter by the calling thread and
// by helper tasks on XLA's pool. The caller returns only once every chunk is
// done; helpers that start late find no chunk left and touch only `Shared`.

constexpr int64_t kChunk = 1 << 16;

struct Chunk {
  int32_t leaf;
  int64_t begin, end;
};

struct Shared {
  std::vector<Chunk> chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;
};

void work(Shared& sh, const std::vector<Leaf>& leaves, const Scalars& s, bool adamw, bool write_params,
          ChunkFn run_chunk) {
  const int64_t total = static_cast<int64_t>(sh.chunks.size());
  int64_t finished = 0;
  for (int64_t i = sh.next.fetch_add(1); i < total; i = sh.next.fetch_add(1)) {
    const Chunk& c = sh.chunks[i];
    if (!run_chunk(leaves[c.leaf], c.begin, c.end, s, adamw, write_params)) sh.failed = true;
    ++finished;
  }
  if (finished > 0 && sh.done.fetch_add(finished) + finished == total) {
    std::lock_guard<std::mutex> lock(sh.mu);
    sh.cv.notify_all();
  }
}

ffi::Error AdamWImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, int32_t adamw_mode, int32_t write_params,
                     ffi::Span<const int32_t> decay, ffi::Span<const int32_t> has_param) {
  if (kIsa.variant == nullptr) return ffi::Error::InvalidArgument(kIsa.problem);
  const size_t n_leaves = decay.size();
  if (has_param.size() != n_leaves || rets.size() != 3 * n_leaves) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: inconsistent leaf counts");
  }
  if (scalars.element_count() != 8) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: expected 8 scalars");
  }
  const float* sc = scalars.typed_data();
  const Scalars s{sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7] != 0.0f};

  std::vector<Leaf> leaves;
  leaves.reserve(n_leaves);
  size_t arg = 0;
  for (size_t i = 0; i < n_leaves; ++i) {
    auto g = args.get<ffi::AnyBuffer>(arg++);
    auto m = args.get<ffi::AnyBuffer>(arg++);
    auto v = args.get<ffi::AnyBuffer>(arg++);
    if (!g.has_value() || !m.has_value() || !v.has_value()) {
      return ffi::Error::InvalidArgument("optax_hybrid adamw: missing leaf operand");
    }
    void* p = nullptr;
    if (has_param[i]) {
      auto pb = args.get<ffi::AnyBuffer>(arg++);
      if (!pb.has_value()) return ffi::Error::InvalidArgument("optax_hybrid adamw: missing param");
      p = pb->untyped_data();
    }
    auto out = rets.get<ffi::AnyBuffer>(3 * i);
    auto m_out = rets.get<ffi::AnyBuffer>(3 * i + 1);
    auto v_out = rets.get<ffi::AnyBuffer>(3 * i + 2);
    if (!out.has_value() || !m_out.has_value() || !v_out.has_value()) {
      return ffi::Error::InvalidArgument("optax_hybrid adamw: missing result");
    }
    // Moments are updated in place: copy in when XLA did not alias them.
    if ((*m_out)->untyped_data() != m->untyped_data()) {
      std::memcpy((*m_out)->untyped_data(), m->untyped_data(), m->size_bytes());
    }
    if ((*v_out)->untyped_data() != v->untyped_data()) {
      std::memcpy((*v_out)->untyped_data(), v->untyped_data(), v->size_bytes());
    }
    if ((write_params || decay[i]) && p == nullptr) {
      return ffi::Error::InvalidArgument("optax_hybrid adamw: this leaf needs its param");
    }
    if (m->element_type() != v->element_type()) {
      return ffi::Error::InvalidArgument("optax_hybrid adamw: mu and nu dtypes differ");
    }
    leaves.push_back(Leaf{g->untyped_data(), (*m_out)->untyped_data(), (*v_out)->untyped_data(), p,
                          (*out)->untyped_data(), static_cast<int64_t>(g->element_count()),
                          kind_of(g->element_type()), kind_of(m->element_type()),
                          kind_of((*out)->element_type()), decay[i] != 0});
  }

  auto sh = std::make_shared<Shared>();
  for (size_t i = 0; i < leaves.size(); ++i) {
    for (int64_t b = 0; b < leaves[i].n; b += kChunk) {
      sh->chunks.push_back(Chunk{static_cast<int32_t>(i), b, std::min(leaves[i].n, b + kChunk)});
    }
  }
  const int64_t total = static_cast<int64_t>(sh->chunks.size());
  if (total == 0) return ffi::Error::Success();

  auto run = [&leaves, &s, adamw = adamw_mode != 0, write = write_params != 0,
              run_chunk = kIsa.variant->run_chunk](Shared& shared) {
    work(shared, leaves, s, adamw, write, run_chunk);
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total - 1);
  // Helpers hold `sh` alive; they may outlive this call but then find no chunk.
  // They must not touch `leaves` or `s` after the caller returns, which holds
  // because a helper only reads them while it owns an unfinished chunk.
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([sh, run]() { run(*sh); });
  }
  run(*sh);
  {
    std::unique_lock<std::mutex> lock(sh->mu);
    sh->cv.wait(lock, [&] { return sh->done.load() == total; });
  }
  if (sh->failed) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: unsupported dtype combination");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxHybridAdamWCpu, AdamWImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int32_t>("adamw_mode")
                                  .Attr<int32_t>("write_params")
                                  .Attr<ffi::Span<const int32_t>>("decay")
                                  .Attr<ffi::Span<const int32_t>>("has_param"));

// Which instruction set the kernel runs, for optax_hybrid.kernels.native_cpu
// (through ctypes): its name, or nullptr when OPTAX_HYBRID_NATIVE_ISA asks for
// one this build or CPU does not have (then OptaxHybridIsaProblem says why).
extern "C" __attribute__((visibility("default"))) const char* OptaxHybridIsa() {
  return kIsa.variant == nullptr ? nullptr : kIsa.variant->name;
}
extern "C" __attribute__((visibility("default"))) const char* OptaxHybridIsaProblem() {
  return kIsa.variant == nullptr ? kIsa.problem : nullptr;
}
// The instruction sets of this build that this CPU runs, widest first, space-separated.
extern "C" __attribute__((visibility("default"))) const char* OptaxHybridIsasThisCpuRuns() {
  return kIsa.cpu_runs;
}
