// The native kernel's work loop alone, without JAX: the portable build's
// instruction-set copy (the one native_cpu.cc picks, or OPTAX_HYBRID_NATIVE_ISA)
// against another build of the loop, typically an older native_cpu.cc compiled
// with -march=native. One thread, one leaf updated in place (a tx.step: the new
// param overwrites the old), the two timed alternately; medians, minimums and
// the median of the paired ratios. With a leaf that fits in L2 (64K elements)
// the loop is compute-bound, so code differences are not hidden by memory
// bandwidth or by the other work on a shared machine. Figures, not a test.
//
// One source, compiled three times (from the repository root; $I is
// `python -c "import jax.ffi; print(jax.ffi.include_dir())"`):
//
//   git show c33b3d1:optax_hybrid/kernels/native_cpu.cc > /tmp/native_cpu_march_native.cc
//   g++ -O3 -march=native -std=c++17 -fno-math-errno -w -I$I -DNATIVE_LOOP_SIDE=1 \
//       -DNATIVE_LOOP_SOURCE='"/tmp/native_cpu_march_native.cc"' -c benchmarks/native_loop.cc -o /tmp/loop_other.o
//   g++ -O3 -std=c++17 -fno-math-errno -w -I$I -DNATIVE_LOOP_SIDE=2 -c benchmarks/native_loop.cc -o /tmp/loop_portable.o
//   g++ -O2 -std=c++17 -DNATIVE_LOOP_SIDE=0 benchmarks/native_loop.cc /tmp/loop_other.o /tmp/loop_portable.o \
//       -o /tmp/native_loop
//   /tmp/native_loop bf16 65536 100 41    # dtype (f32, bf16, f16), elements, passes per timing, timings
//
// Side 1 calls the other source's run_leaf<true> (the per-chunk body before the
// instruction-set copies existed); side 2 the chosen copy of this checkout's
// native_cpu.cc. Both use the kernel's internal names: update this file when
// they change.

#if NATIVE_LOOP_SIDE == 1 || NATIVE_LOOP_SIDE == 2

#if NATIVE_LOOP_SIDE == 1
#define OptaxHybridAdamWCpu OptaxHybridAdamWCpu_other  // both sides define the handler
#include NATIVE_LOOP_SOURCE
#define NATIVE_LOOP_PASS other_pass
#else
#include "../optax_hybrid/kernels/native_cpu.cc"
#define NATIVE_LOOP_PASS portable_pass
extern "C" const char* portable_isa() { return kIsa.variant->name; }
#endif

// kind: 0 f32, 1 bf16, 2 f16 params and gradients; float32 moments; AdamW decay.
extern "C" void NATIVE_LOOP_PASS(void* g, void* m, void* v, void* p, int64_t n, int kind) {
  const Kind t = kind == 0 ? Kind::kF32 : kind == 1 ? Kind::kBF16 : Kind::kF16;
  const Leaf leaf{g, m, v, p, p, n, t, Kind::kF32, t, true};
  const Scalars s{1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 0.5f, 0.7f, true};
  for (int64_t b = 0; b < n; b += kChunk) {
#if NATIVE_LOOP_SIDE == 1
    run_leaf<true>(leaf, b, std::min(n, b + kChunk), s, true);
#else
    kIsa.variant->run_chunk(leaf, b, std::min(n, b + kChunk), s, true, true);
#endif
  }
}

#else  // the driver

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern "C" void other_pass(void*, void*, void*, void*, int64_t, int);
extern "C" void portable_pass(void*, void*, void*, void*, int64_t, int);
extern "C" const char* portable_isa();

using Pass = void (*)(void*, void*, void*, void*, int64_t, int);

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s f32|bf16|f16 ELEMENTS PASSES TIMINGS\n", argv[0]);
    return 2;
  }
  const std::string dtype = argv[1];
  const int kind = dtype == "f32" ? 0 : dtype == "bf16" ? 1 : dtype == "f16" ? 2 : -1;
  if (kind < 0) {
    std::fprintf(stderr, "dtype must be f32, bf16 or f16, not %s\n", argv[1]);
    return 2;
  }
  const int64_t n = std::atoll(argv[2]);
  const int passes = std::atoi(argv[3]), timings = std::atoi(argv[4]);
  const size_t width = kind == 0 ? 4 : 2;
  std::vector<char> g(n * width), p(n * width);
  std::vector<float> m(n, 0.01f), v(n, 0.001f);
  // g = 1e-3 and p = 0.5 in the storage dtype (bit patterns of float32, bfloat16, float16).
  for (int64_t i = 0; i < n; ++i) {
    if (kind == 0) {
      const float gi = 1e-3f, pi = 0.5f;
      std::memcpy(&g[4 * i], &gi, 4);
      std::memcpy(&p[4 * i], &pi, 4);
    } else {
      const uint16_t gi = kind == 1 ? 0x3a83 : 0x1419, pi = kind == 1 ? 0x3f00 : 0x3800;
      std::memcpy(&g[2 * i], &gi, 2);
      std::memcpy(&p[2 * i], &pi, 2);
    }
  }
  auto time = [&](Pass pass) {
    const auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < passes; ++k) pass(g.data(), m.data(), v.data(), p.data(), n, kind);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  };
  for (int w = 0; w < 2; ++w) time(other_pass), time(portable_pass);
  std::vector<double> other, portable, ratio;
  for (int r = 0; r < timings; ++r) {  // alternate which one goes first
    const double a = r % 2 ? time(other_pass) : 0.0;
    const double b = time(portable_pass);
    const double c = r % 2 ? a : time(other_pass);
    other.push_back(c);
    portable.push_back(b);
    ratio.push_back(b / c);
  }
  const double other_min = *std::min_element(other.begin(), other.end());
  const double portable_min = *std::min_element(portable.begin(), portable.end());
  std::printf("%s, %lld elements x %d passes, portable isa %s: other build median %.2f ms (min %.2f), "
              "portable median %.2f ms (min %.2f); portable/other: median of paired ratios %.3f, of minimums %.3f\n",
              dtype.c_str(), static_cast<long long>(n), passes, portable_isa(), median(other), other_min,
              median(portable), portable_min, median(ratio), portable_min / other_min);
  return 0;
}

#endif
