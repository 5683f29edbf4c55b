// The native kernel's work loop alone, without JAX: one leaf stepped in place
// with float32 moments and with 8-bit moments, one thread, the two timed
// alternately (medians, minimums and the median of the paired ratios). With a
// leaf that fits in L2 (64K values) both are compute-bound, so the figures
// show what the 8-bit loop costs per value; with 16M values the float32 step
// is bound by memory. Figures, not a test. The instruction-set copy is the one
// native_cpu.cc picks, or OPTAX_HYBRID_NATIVE_ISA's.
//
// From the repository root ($I is `python -c "import jax.ffi; print(jax.ffi.include_dir())"`):
//
//   python -c "import numpy as np; from optax_hybrid.kernels import native_cpu; \
//              native_cpu.CODE_TABLES.astype(np.float32).tofile('/tmp/code_tables.bin')"
//   g++ -O3 -std=c++17 -fno-math-errno -w -I$I benchmarks/native_8bit_loop.cc -o /tmp/native_8bit_loop
//   taskset -c 1 /tmp/native_8bit_loop /tmp/code_tables.bin 65536 100 31   # tables, values, passes, timings
//
// Uses the kernel's internal names (Leaf, Scalars, QuantTables, search_for,
// byte_planes, kIsa): update this file when they change.

#include "../optax_hybrid/kernels/native_cpu.cc"

#include <chrono>
#include <cstdio>
#include <random>

namespace {

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s CODE_TABLES.bin VALUES PASSES TIMINGS\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[2]);
  const int passes = std::atoi(argv[3]), timings = std::atoi(argv[4]);
  std::vector<float> t(4 * kCodes);
  FILE* f = std::fopen(argv[1], "rb");
  if (f == nullptr || std::fread(t.data(), sizeof(float), t.size(), f) != t.size()) {
    std::fprintf(stderr, "%s: expected 4 x 256 float32 (native_cpu.CODE_TABLES)\n", argv[1]);
    return 2;
  }
  std::fclose(f);
  const QuantTables tables{t.data(), t.data() + kCodes, &search_for(t.data() + 2 * kCodes),
                           &search_for(t.data() + 3 * kCodes), byte_planes(t.data()), byte_planes(t.data() + kCodes)};
  // Rows of 1024 values (4 blocks); moments and gradients of an Adam run's magnitudes.
  const int64_t row = 1024, block = 256, blocks = n / row * (row / block);
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g(n), p(n), m(n), v(n);
  for (int64_t i = 0; i < n; ++i) {
    g[i] = 1e-3f * normal(rng);
    p[i] = 0.5f * normal(rng);
    m[i] = 1e-3f * normal(rng);
    v[i] = 1e-6f * normal(rng) * normal(rng);
  }
  std::vector<uint8_t> m_codes(n), v_codes(n);
  for (int64_t i = 0; i < n; ++i) m_codes[i] = rng() & 255, v_codes[i] = rng() & 255;
  std::vector<float> m_scales(blocks, 1e-2f), v_scales(blocks, 1e-5f);
  const Scalars s{1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 0.5f, 0.7f, true};
  const Leaf f32{g.data(), m.data(), v.data(), p.data(), p.data(), n, Kind::kF32, Kind::kF32, Kind::kF32, true};
  Leaf q8{g.data(), m_codes.data(), v_codes.data(), p.data(), p.data(), n, Kind::kF32, Kind::kU8, Kind::kF32, true};
  q8.m_scales = m_scales.data();
  q8.v_scales = v_scales.data();
  q8.row = row;
  q8.blocks_per_row = row / block;
  q8.block = block;
  q8.tables = &tables;
  // A tx.step (AdamW, the new param written in place), chunk by chunk as the kernel splits it.
  const auto pass = [&](const Leaf& leaf) {
    const int64_t items = leaf.work_items(), per_chunk = std::max<int64_t>(1, kChunk / leaf.values_per_item());
    for (int64_t b = 0; b < items; b += per_chunk) kIsa.variant->run_chunk(leaf, b, std::min(items, b + per_chunk), s, true, true);
  };
  const auto ns_per_value = [&](const Leaf& leaf) {
    const auto start = std::chrono::steady_clock::now();
    for (int k = 0; k < passes; ++k) pass(leaf);
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / passes / n;
  };
  for (int w = 0; w < 3; ++w) ns_per_value(f32), ns_per_value(q8);
  std::vector<double> a, b, ratio;
  for (int r = 0; r < timings; ++r) {
    a.push_back(ns_per_value(f32));
    b.push_back(ns_per_value(q8));
    ratio.push_back(b.back() / a.back());
  }
  std::printf("isa %s, %lld values x %d passes: float32 moments %.3f ns/value (min %.3f), 8-bit %.3f (min %.3f); "
              "8-bit / float32: median of paired ratios %.3f\n",
              kIsa.variant->name, static_cast<long long>(n), passes, median(a), *std::min_element(a.begin(), a.end()),
              median(b), *std::min_element(b.begin(), b.end()), median(ratio));
  return 0;
}
