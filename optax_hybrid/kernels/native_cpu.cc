// The HybridAdam / AdamW step for CPU-resident leaves, as an XLA FFI custom call.
//
// One call updates every leaf it is given: for each leaf it reads the gradient,
// both moments and (when needed) the parameter once, and writes the moments in
// place (aliased by the caller) plus either the update (Optax contract) or the
// new parameter in place (fused apply). Float32 math whatever the storage
// dtype; bfloat16 and float16 leaves with float32 or same-dtype moments, or
// with 8-bit block-wise moments (codes and per-block scales, the format of
// quantized.py, whose code maps and thresholds come in as an operand). Work is
// split into chunks spread over XLA's intra-op thread pool.
//
// Each chunk runs through one function, compiled once per instruction set
// (AVX-512 with and without VBMI, AVX2, baseline) from one body, the 8-bit
// loops written per vector width; the library picks one when it loads
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
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
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

// What every value's step needs from the scalars, computed once per range.
struct StepConstants {
  float b1, one_minus_b1, b2, one_minus_b2, bc2_sqrt, eps, step, wd, lr_wd;
  OPTAX_HYBRID_BODY explicit StepConstants(const Scalars& s)
      : b1(s.b1), one_minus_b1(1.0f - s.b1), b2(s.b2), one_minus_b2(1.0f - s.b2), bc2_sqrt(s.bc2_sqrt),
        eps(s.eps), step(-(s.lr / s.bc1)), wd(s.wd), lr_wd(s.lr * s.wd) {}
};

// One value's step from its old moments: the new moments and the first
// result (the update, or the new param when kWriteParams).
struct ValueStep {
  float m, v, first;
};
template <bool kDecoupled, bool kL2, bool kWriteParams>
OPTAX_HYBRID_BODY ValueStep step_value(float g, float p, float m_old, float v_old, const StepConstants& c) {
  if constexpr (kL2) g = g + c.wd * p;
  const float m = c.b1 * m_old + c.one_minus_b1 * g;
  const float v = c.b2 * v_old + c.one_minus_b2 * (g * g);
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  float u = c.step * (m / denom);
  if constexpr (kDecoupled) u = u - c.lr_wd * p;
  return ValueStep{m, v, kWriteParams ? p + u : u};
}

// ---------------------------------------------------------------------------
// One contiguous range of one leaf. T: gradient/param storage, S: moment storage,
// U: storage of the first output (update, or new param when kWriteParams).

template <typename T, typename S, typename U, bool kDecoupled, bool kL2, bool kWriteParams>
OPTAX_HYBRID_BODY void step_range(const T* __restrict g, S* __restrict m, S* __restrict v, const T* __restrict p,
                U* __restrict out, int64_t begin, int64_t end, const Scalars& s) {
  const StepConstants c(s);
  for (int64_t i = begin; i < end; ++i) {
    float pi = 0.0f;
    if constexpr (kDecoupled || kL2 || kWriteParams) pi = to_f32(p[i]);
    const ValueStep r = step_value<kDecoupled, kL2, kWriteParams>(to_f32(g[i]), pi, to_f32(m[i]), to_f32(v[i]), c);
    m[i] = from_f32<S>(r.m);
    v[i] = from_f32<S>(r.v);
    out[i] = from_f32<U>(r.first);
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

// ---------------------------------------------------------------------------
// 8-bit block-wise moments (quantized.py): a moment value is
// code_map[code] * scale, one float32 scale per block of up to `block` values
// within one row (the last block of a row may be shorter). The first moment
// uses the signed map, the second the unsigned one; both maps and their
// thresholds (midpoints, padded with +inf) arrive as an operand.

// Values of one block held on the stack between the step and the quantization.
constexpr int64_t kMaxBlock = 2048;
constexpr int kCodes = 256;

OPTAX_HYBRID_BODY uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
OPTAX_HYBRID_BODY float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The code of a normalized value q is the number of thresholds strictly below
// it: the nearest code, a value on a midpoint taking the lower one, NaN taking
// code 0 (every comparison with NaN is false), as quantized.nearest_codes
// counts them.
//
// A binary search costs 8 dependent table loads per value. Instead, q's bit
// pattern shifted right by `shift` (arithmetically: its sign, exponent and a
// few leading mantissa bits) indexes a table over every bit pattern. `shift`
// is the largest for which no bucket of 2**shift consecutive patterns holds
// two thresholds, so an entry gives the number of thresholds below its bucket
// and the position in the bucket of the one threshold inside it, if any; one
// comparison of q's position with it finishes the count. Positions count
// from the bucket's value nearest zero, so for negative q a larger position
// is a smaller value: positions are mirrored there ("directed") to keep
// larger = larger. The table is derived from the thresholds operand, once per
// distinct table (search_for). NaN has no place in it: blocks whose scale is
// not finite (the only way a NaN reaches the search) take the binary search.
struct CodeSearch {
  float thresholds[kCodes];      // a copy of the operand's table, ascending
  uint32_t shift = 0;            // 0: no shift keeps buckets apart, binary search only
  std::vector<int32_t> entries;  // 2**(32 - shift): (below | split << 8), split 0xffffff if none
  const int32_t* at_zero = nullptr;  // the entry of bucket index 0 (indices are signed)
};

constexpr uint32_t kNoSplit = 0xffffffu;

OPTAX_HYBRID_BODY int32_t code_by_binary_search(const float* __restrict t, float q) {
  int32_t code = t[kCodes / 2 - 1] < q ? kCodes / 2 : 0;
  for (int32_t step = kCodes / 4; step > 0; step /= 2) code += t[code + step - 1] < q ? step : 0;
  return code;
}

// q's position in its bucket, larger for larger q.
OPTAX_HYBRID_BODY uint32_t directed_position(uint32_t bits, uint32_t shift) {
  return (bits ^ static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31)) & ((1u << shift) - 1);
}

// The code of a q that is not NaN, from the table.
OPTAX_HYBRID_BODY int32_t code_by_table(const int32_t* __restrict at_zero, uint32_t shift, float q) {
  const uint32_t u = bits_of(q);
  const uint32_t entry = static_cast<uint32_t>(at_zero[static_cast<int32_t>(u) >> shift]);
  return static_cast<int32_t>(entry & 0xffu) + (directed_position(u, shift) > (entry >> 8) ? 1 : 0);
}

// The number of thresholds strictly below q (q not NaN).
int32_t count_below(const float* t, float q) {
  return static_cast<int32_t>(std::lower_bound(t, t + kCodes, q) - t);
}

// Fills cs's table for `shift`; false if a bucket would hold two thresholds.
bool try_table(CodeSearch& cs, uint32_t shift) {
  const int64_t half = int64_t{1} << (31 - shift);
  const uint32_t width = 1u << shift;
  cs.shift = shift;
  cs.entries.assign(2 * half, 0);
  cs.at_zero = cs.entries.data() + half;
  // Largest magnitudes first: the thresholds are densest near 1, so a shift
  // that is too coarse fails early.
  for (int64_t k = half - 1; k >= 0; --k) {
    const uint32_t low = static_cast<uint32_t>(k) << shift, high = low | (width - 1);
    if (low > 0x7f800000u) continue;  // NaN patterns only
    const float a_min = float_of(low), a_max = float_of(std::min(high, 0x7f800000u));
    for (const bool negative : {false, true}) {
      const float q_min = negative ? -a_max : a_min, q_max = negative ? -a_min : a_max;
      const int32_t below = count_below(cs.thresholds, q_min), inside = count_below(cs.thresholds, q_max) - below;
      if (inside > 1) return false;
      uint32_t split = kNoSplit;
      if (inside == 1) {
        const uint32_t position = bits_of(cs.thresholds[below]) & (width - 1);
        split = negative ? width - 1 - position : position;
      }
      const int64_t index = negative ? -half + k : k;  // the arithmetic shift of the pattern
      cs.entries[index + half] = static_cast<int32_t>(static_cast<uint32_t>(below) | split << 8);
    }
  }
  return true;
}

void build_search(CodeSearch& cs) {
  // Up to 2**18 entries (1 MiB); past that the binary search is cheaper.
  for (uint32_t shift = 23; shift >= 14; --shift) {
    if (try_table(cs, shift)) return;
  }
  cs.shift = 0;
  cs.entries.clear();
  cs.at_zero = nullptr;
}

// The search for a thresholds table (256 ascending float32), built on first
// use and kept for the life of the process (in practice two: the signed and
// the unsigned map's thresholds).
const CodeSearch& search_for(const float* thresholds) {
  static std::mutex mu;
  static auto* known = new std::vector<std::unique_ptr<CodeSearch>>();  // never destroyed: used by pool threads
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& cs : *known) {
    if (std::memcmp(cs->thresholds, thresholds, sizeof cs->thresholds) == 0) return *cs;
  }
  auto cs = std::make_unique<CodeSearch>();
  std::memcpy(cs->thresholds, thresholds, sizeof cs->thresholds);
  build_search(*cs);
  known->push_back(std::move(cs));
  return *known->back();
}

// The largest |x| of a block as the largest bit pattern of |x|: exact, and a
// NaN (whose pattern is above every number's) wins, as in jnp.max.
OPTAX_HYBRID_BODY uint32_t largest_magnitude_bits(const float* __restrict x, int64_t n) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, bits_of(x[i]) & 0x7fffffffu);
  return largest;
}

// A block's values are normalized as quantized.normalize says: times the
// reciprocal of the scale (of 1 for a zero or subnormal scale); a scale above 2**126
// (0x7e800000), whose reciprocal would be subnormal, first shrinks the values
// and the scale by 2**-64. by_reciprocal: no shrinking needed.
OPTAX_HYBRID_BODY bool by_reciprocal(uint32_t largest) { return largest <= 0x7e800000u; }
constexpr float kShrinkHuge = 0x1p-64f;
// The factor of a block that needs no shrinking.
OPTAX_HYBRID_BODY float reciprocal_of_scale(uint32_t largest) {
  return largest < 0x00800000u ? 1.0f : 1.0f / float_of(largest);
}

// Quantizes one block given its largest magnitude: returns the scale and
// writes the codes of the block's normalized values.
OPTAX_HYBRID_BODY float quantize_block(const float* __restrict x, int64_t n, uint8_t* __restrict codes, const CodeSearch& cs,
                            uint32_t largest) {
  const float scale = float_of(largest);
  const bool shrinks = !by_reciprocal(largest);
  const float shrink = shrinks ? kShrinkHuge : 1.0f;
  const float factor = shrinks ? 1.0f / (scale * kShrinkHuge) : reciprocal_of_scale(largest);
  if (cs.shift == 0 || largest >= 0x7f800000u) {  // no table, or an infinite or NaN scale
    for (int64_t i = 0; i < n; ++i) {
      codes[i] = static_cast<uint8_t>(code_by_binary_search(cs.thresholds, x[i] * shrink * factor));
    }
  } else {
    const int32_t* __restrict at_zero = cs.at_zero;
    const uint32_t shift = cs.shift;
    for (int64_t i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(code_by_table(at_zero, shift, x[i] * shrink * factor));
  }
  return scale;
}

// A code map's 256 float32 values as four planes of bytes (plane b holds byte
// b of every value), for table lookups by byte permutes (AVX-512 VBMI).
struct BytePlanes {
  alignas(64) uint8_t plane[4][kCodes];
};

BytePlanes byte_planes(const float* map) {
  BytePlanes planes;
  for (int c = 0; c < kCodes; ++c) {
    const uint32_t u = bits_of(map[c]);
    for (int b = 0; b < 4; ++b) planes.plane[b][c] = static_cast<uint8_t>(u >> (8 * b));
  }
  return planes;
}

struct QuantTables {
  const float* signed_map;    // 256 values, the first moment's
  const float* unsigned_map;  // 256 values, the second moment's
  const CodeSearch* signed_search;
  const CodeSearch* unsigned_search;
  BytePlanes signed_planes, unsigned_planes;  // the maps again, as byte planes
};

// One block of one leaf (n <= kMaxBlock values of one row), in portable C++
// for the compiler to vectorize: the step from the dequantized moments, the
// update (or new param) from the new moments before they are rounded, then
// both moments quantized in place.
template <typename T, typename U, bool kDecoupled, bool kL2, bool kWriteParams>
OPTAX_HYBRID_BODY void step_block(const T* __restrict g, const T* __restrict p, U* __restrict out, uint8_t* __restrict mc,
                       uint8_t* __restrict vc, float* __restrict m_scale, float* __restrict v_scale, int64_t n,
                       const Scalars& s, const QuantTables& q) {
  alignas(64) float m_new[kMaxBlock];
  alignas(64) float v_new[kMaxBlock];
  const float* __restrict signed_map = q.signed_map;
  const float* __restrict unsigned_map = q.unsigned_map;
  const float ms = *m_scale, vs = *v_scale;
  const StepConstants c(s);
  for (int64_t i = 0; i < n; ++i) {
    float pi = 0.0f;
    if constexpr (kDecoupled || kL2 || kWriteParams) pi = to_f32(p[i]);
    const ValueStep r = step_value<kDecoupled, kL2, kWriteParams>(to_f32(g[i]), pi, signed_map[mc[i]] * ms,
                                                                  unsigned_map[vc[i]] * vs, c);
    m_new[i] = r.m;
    v_new[i] = r.v;
    out[i] = from_f32<U>(r.first);
  }
  *m_scale = quantize_block(m_new, n, mc, *q.signed_search, largest_magnitude_bits(m_new, n));
  *v_scale = quantize_block(v_new, n, vc, *q.unsigned_search, largest_magnitude_bits(v_new, n));
}

enum class Kind { kF32, kBF16, kF16, kU8, kOther };

Kind kind_of(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return Kind::kF32;
    case ffi::DataType::BF16:
      return Kind::kBF16;
    case ffi::DataType::F16:
      return Kind::kF16;
    case ffi::DataType::U8:
      return Kind::kU8;
    default:
      return Kind::kOther;
  }
}

struct Leaf {
  void* g;
  void* m;  // with 8-bit moments (s == kU8): the codes
  void* v;
  void* p;  // nullptr when the leaf needs no param
  void* out;
  int64_t n;
  Kind t, s, u;
  bool decay;
  // 8-bit moments only: the per-block scales, the row length (the last
  // axis), the blocks per row and the block size, and the code tables.
  float* m_scales = nullptr;
  float* v_scales = nullptr;
  int64_t row = 0, blocks_per_row = 0, block = 0;
  const QuantTables* tables = nullptr;

  // Work is split over values, or over whole blocks for 8-bit moments.
  int64_t work_items() const { return s == Kind::kU8 ? n / row * blocks_per_row : n; }
  int64_t values_per_item() const { return s == Kind::kU8 ? std::min(block, row) : 1; }
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

// Where block j of a leaf with 8-bit moments starts (block j is block
// j % blocks_per_row of row j / blocks_per_row), and how many values it has.
struct BlockAt {
  int64_t first_value, n;
};
OPTAX_HYBRID_BODY BlockAt block_at(const Leaf& leaf, int64_t j) {
  const int64_t start = j % leaf.blocks_per_row * leaf.block;
  return BlockAt{j / leaf.blocks_per_row * leaf.row + start, std::min(leaf.block, leaf.row - start)};
}

// Blocks [begin, end) of a leaf with 8-bit moments, one after the other.
template <typename T, typename U, bool kDecoupled, bool kL2, bool kWriteParams>
OPTAX_HYBRID_BODY void step_blocks_portable(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s) {
  auto* g = static_cast<const T*>(leaf.g);
  auto* mc = static_cast<uint8_t*>(leaf.m);
  auto* vc = static_cast<uint8_t*>(leaf.v);
  auto* p = static_cast<const T*>(leaf.p);
  auto* out = static_cast<U*>(leaf.out);
  for (int64_t j = begin; j < end; ++j) {
    const BlockAt at = block_at(leaf, j);
    const int64_t i = at.first_value;
    step_block<T, U, kDecoupled, kL2, kWriteParams>(g + i, p == nullptr ? nullptr : p + i, out + i, mc + i, vc + i,
                                                    leaf.m_scales + j, leaf.v_scales + j, at.n, s, *leaf.tables);
  }
}

// The 8-bit path's rule (skip, decoupled decay, L2 decay, none) over blocks
// [begin, end), BLOCKS being the loops: step_blocks_portable or _avx512, with
// EXTRA (empty, or a comma and more arguments) after the common ones.
#define OPTAX_HYBRID_QUANTIZED_RULE(BLOCKS, EXTRA)                                              \
  if (!s.step_ok) { /* codes and scales stay; consecutive blocks are consecutive values */    \
    skip_range<T, U, kWriteParams>(static_cast<const T*>(leaf.p), static_cast<U*>(leaf.out),    \
                                   block_at(leaf, begin).first_value, block_at(leaf, end).first_value); \
  } else if (leaf.decay && adamw) {                                                            \
    BLOCKS<T, U, true, false, kWriteParams>(leaf, begin, end, s EXTRA);                        \
  } else if (leaf.decay) {                                                                     \
    BLOCKS<T, U, false, true, kWriteParams>(leaf, begin, end, s EXTRA);                        \
  } else {                                                                                     \
    BLOCKS<T, U, false, false, kWriteParams>(leaf, begin, end, s EXTRA);                       \
  }

// The dtypes the 8-bit path takes (T: grad and param; U: the first result):
// U == f32, or U == T when writing params. RUN<T, U, kWriteParams> runs them.
#define OPTAX_HYBRID_QUANTIZED_DTYPES(RUN, EXTRA)                                                                 \
  if constexpr (kWriteParams) {                                                                           \
    if (leaf.t == Kind::kF32 && leaf.u == Kind::kF32) return RUN<float, float, true>(leaf, begin, end, s, adamw EXTRA), true; \
    if (leaf.t == Kind::kBF16 && leaf.u == Kind::kBF16) return RUN<BF16, BF16, true>(leaf, begin, end, s, adamw EXTRA), true; \
    if (leaf.t == Kind::kF16 && leaf.u == Kind::kF16) return RUN<F16, F16, true>(leaf, begin, end, s, adamw EXTRA), true; \
  } else {                                                                                                \
    if (leaf.t == Kind::kF32 && leaf.u == Kind::kF32) return RUN<float, float, false>(leaf, begin, end, s, adamw EXTRA), true; \
    if (leaf.t == Kind::kBF16 && leaf.u == Kind::kF32) return RUN<BF16, float, false>(leaf, begin, end, s, adamw EXTRA), true; \
    if (leaf.t == Kind::kF16 && leaf.u == Kind::kF32) return RUN<F16, float, false>(leaf, begin, end, s, adamw EXTRA), true; \
  }

template <typename T, typename U, bool kWriteParams>
OPTAX_HYBRID_BODY void run_quantized_leaf_typed(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s,
                                                bool adamw) {
  OPTAX_HYBRID_QUANTIZED_RULE(step_blocks_portable, )
}

// The per-chunk body: one range of one leaf, any supported dtype combination
// and rule. Every loop of the kernel lives below this function, so that each
// instruction-set copy (run_chunk_*) gets all of them (the AVX-512 and AVX2
// copies run their own 8-bit loops: run_leaf_avx512, run_leaf_avx2).
// Supported combinations: T in {f32, bf16, f16}; S == f32 or S == T; U == f32 if
// S == f32 else T (the dtype optax returns); U == T when writing params. With
// 8-bit moments (S == u8 codes): U == f32, or U == T when writing params.
// `begin` and `end` count values, or blocks for 8-bit moments (Leaf::work_items).
template <bool kWriteParams>
OPTAX_HYBRID_BODY bool run_leaf(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw) {
  if (leaf.s == Kind::kU8) {
    OPTAX_HYBRID_QUANTIZED_DTYPES(run_quantized_leaf_typed, )
    return false;
  }
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


#if defined(__x86_64__) || defined(__i386__)
// The AVX-512 loops exist only in the AVX-512 copy of the per-chunk work
// (run_leaf_avx512, below). Each of their functions carries the instruction
// sets it uses (the library is built without -march) and is inlined into that
// copy: GCC inlines a function only into one whose instruction sets include
// its own, so none of them may sit under a function of the portable body,
// which every copy shares.
#define OPTAX_HYBRID_AVX512_ATTRIBUTES __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"), always_inline))
#define OPTAX_HYBRID_AVX512 inline OPTAX_HYBRID_AVX512_ATTRIBUTES

// The same with AVX-512 (F, BW, VL, DQ): the code search's lookups are
// hardware gathers, which compilers tuned for generic x86-64 do not emit for
// the portable loops. A block's moments are first dequantized into its
// buffers (by byte permutes where the CPU has VBMI, else by gathers), then
// stepped; the codes of block j-1 are computed inside block j's step loop, so
// that their gathers and integer work overlap block j's divisions.

// 16 values as float32, the lanes outside `lanes` read as zero / left untouched.
OPTAX_HYBRID_AVX512 __m512 load16(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
OPTAX_HYBRID_AVX512 __m512 load16(const BF16* p, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}
OPTAX_HYBRID_AVX512 __m512 load16(const F16* p, __mmask16 lanes) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, p)); }
OPTAX_HYBRID_AVX512 void store16(float* p, __mmask16 lanes, __m512 x) { _mm512_mask_storeu_ps(p, lanes, x); }
OPTAX_HYBRID_AVX512 void store16(BF16* p, __mmask16 lanes, __m512 x) {  // as from_f32<BF16>: nearest even, NaN kept quiet
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  _mm256_mask_storeu_epi16(p, lanes, _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet)));
}
OPTAX_HYBRID_AVX512 void store16(F16* p, __mmask16 lanes, __m512 x) {
  _mm256_mask_storeu_epi16(p, lanes, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
OPTAX_HYBRID_AVX512 __mmask16 lanes_below(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// CodeSearch's table as vectors, for code_by_table on 16 values at a time.
struct CodeTable16 {
  const int32_t* at_zero;
  __m128i shift;
  __m512i position_bits;  // (2**shift - 1) << 8

  OPTAX_HYBRID_AVX512 explicit CodeTable16(const CodeSearch& cs)
      : at_zero(cs.at_zero),
        shift(_mm_cvtsi32_si128(static_cast<int>(cs.shift))),
        position_bits(_mm512_set1_epi32(static_cast<int>(((1u << cs.shift) - 1) << 8))) {}

  // The codes (in the low byte of each lane) of 16 values that are not NaN.
  OPTAX_HYBRID_AVX512 __m512i codes(__m512 q) const {
    const __m512i u = _mm512_castps_si512(q);
    const __m512i entry = _mm512_i32gather_epi32(_mm512_sra_epi32(u, shift), at_zero, 4);
    // (directed position << 8) > (split << 8 | below)  <=>  directed position > split.
    const __m512i position = _mm512_ternarylogic_epi32(_mm512_slli_epi32(u, 8), _mm512_srai_epi32(u, 31),
                                                       position_bits, 0x28);  // (a ^ b) & c
    const __mmask16 above = _mm512_cmpgt_epu32_mask(position, entry);
    return _mm512_mask_sub_epi32(entry, above, entry, _mm512_set1_epi32(-1));  // below + 1 (below < 255 here)
  }
};

// The hardware prefetchers alone leave the compute-heavy 8-bit loops (AVX-512
// and AVX2) waiting on memory for large leaves; a prefetch kPrefetchValues
// values ahead (four blocks) keeps their streams (grad, param, both codes) in
// L1. Past the end it is a no-op.
constexpr int64_t kPrefetchValues = 1024;
template <typename X>
OPTAX_HYBRID_BODY void prefetch_ahead(const X* x) {  // SSE: every x86-64 copy may inline it
  _mm_prefetch(reinterpret_cast<const char*>(x + kPrefetchValues), _MM_HINT_T0);
}

// out[0 .. n) = map[codes[i]] * scale, by gathers; out is written up to the
// next multiple of 16 (lanes past n read code 0).
OPTAX_HYBRID_AVX512 void dequantize_by_gathers(const uint8_t* codes, int64_t n, const float* map, float scale,
                                               float* out) {
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i code = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(lanes_below(n - i), codes + i));
    _mm512_store_ps(out + i, _mm512_mul_ps(_mm512_i32gather_ps(code, map, 4), factor));
  }
}

// The same by byte permutes (AVX-512 VBMI), 64 values at a time: each byte of
// the 64 values' map entries is one two-table permute per half of the map,
// and four unpacks put the bytes back together as floats. The unpacks work
// within 128-bit lanes and leave value 16q + 4L + j at position 16L + 4q + j,
// so the codes are permuted that way first. out is written up to the next
// multiple of 64. Not inlined: the callers are compiled without VBMI, which
// only this function uses (the CPU is checked before it is chosen).
__attribute__((target("avx512f,avx512bw,avx512vbmi"), noinline)) void dequantize_by_permutes(
    const uint8_t* codes, int64_t n, const BytePlanes& planes, float scale, float* out) {
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4,  5,  6,  7,  20, 21,
      22, 23, 36, 37, 38, 39, 52, 53, 54, 55, 8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43,
      56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
  const __m512i order = _mm512_load_si512(kOrder);
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 64) {
    const __mmask64 lanes = n - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (n - i)) - 1;
    const __m512i code = _mm512_permutexvar_epi8(order, _mm512_maskz_loadu_epi8(lanes, codes + i));
    const __mmask64 upper_half = _mm512_movepi8_mask(code);  // codes 128..255
    __m512i byte[4];
    for (int b = 0; b < 4; ++b) {
      const uint8_t* plane = planes.plane[b];  // four quarters of 64 entries
      const __m512i lower = _mm512_permutex2var_epi8(_mm512_load_si512(plane), code, _mm512_load_si512(plane + 64));
      const __m512i upper = _mm512_permutex2var_epi8(_mm512_load_si512(plane + 128), code,
                                                     _mm512_load_si512(plane + 192));
      byte[b] = _mm512_mask_blend_epi8(upper_half, lower, upper);
    }
    const __m512i low01 = _mm512_unpacklo_epi8(byte[0], byte[1]), high01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(byte[2], byte[3]), high23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
    const __m512i value[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                              _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
    for (int q = 0; q < 4; ++q) _mm512_store_ps(out + i + 16 * q, _mm512_mul_ps(_mm512_castsi512_ps(value[q]), factor));
  }
}

// Blocks [begin, end) of a leaf with 8-bit moments; `vbmi`: dequantize by
// permutes rather than gathers.
template <typename T, typename U, bool kDecoupled, bool kL2, bool kWriteParams>
OPTAX_HYBRID_AVX512 void step_blocks_avx512(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s,
                                            bool vbmi) {
  // New m and v of the block being stepped and of the one before (each holds
  // the dequantized old moments first). Whole 64-value groups are written.
  alignas(64) float buffers[2][2][kMaxBlock];
  const auto* g = static_cast<const T*>(leaf.g);
  auto* mc = static_cast<uint8_t*>(leaf.m);
  auto* vc = static_cast<uint8_t*>(leaf.v);
  const auto* p = static_cast<const T*>(leaf.p);
  auto* out = static_cast<U*>(leaf.out);
  const float* signed_map = leaf.tables->signed_map;
  const float* unsigned_map = leaf.tables->unsigned_map;
  const CodeSearch& m_search = *leaf.tables->signed_search;
  const CodeSearch& v_search = *leaf.tables->unsigned_search;
  const bool tables = m_search.shift != 0 && v_search.shift != 0;
  const CodeTable16 m_table(m_search), v_table(v_search);
  // step_value on 16 values (step16, below).
  const StepConstants c(s);
  const __m512 b1 = _mm512_set1_ps(c.b1), one_minus_b1 = _mm512_set1_ps(c.one_minus_b1);
  const __m512 b2 = _mm512_set1_ps(c.b2), one_minus_b2 = _mm512_set1_ps(c.one_minus_b2);
  const __m512 bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 step = _mm512_set1_ps(c.step), wd = _mm512_set1_ps(c.wd);
  const __m512 lr_wd = _mm512_set1_ps(c.lr_wd);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  // The block before, whose codes are still to be written (pending_n == 0: none).
  int64_t pending_n = 0;
  const float* pending_m = nullptr;
  const float* pending_v = nullptr;
  uint8_t* pending_mc = nullptr;
  uint8_t* pending_vc = nullptr;
  __m512 pending_m_factor = _mm512_set1_ps(1.0f), pending_v_factor = _mm512_set1_ps(1.0f);  // 1 / scale
  // Block j is block b of row `row`, advanced as j is.
  int64_t row = begin / leaf.blocks_per_row, b = begin % leaf.blocks_per_row;
  for (int64_t j = begin; j <= end; ++j) {
    int64_t n = 0, first = 0;
    if (j < end) {
      first = row * leaf.row + b * leaf.block;
      n = std::min(leaf.block, leaf.row - b * leaf.block);
      if (++b == leaf.blocks_per_row) {
        b = 0;
        ++row;
      }
    }
    float* m_new = buffers[j & 1][0];
    float* v_new = buffers[j & 1][1];
    if (n > 0 && vbmi) {
      dequantize_by_permutes(mc + first, n, leaf.tables->signed_planes, leaf.m_scales[j], m_new);
      dequantize_by_permutes(vc + first, n, leaf.tables->unsigned_planes, leaf.v_scales[j], v_new);
    } else if (n > 0) {
      dequantize_by_gathers(mc + first, n, signed_map, leaf.m_scales[j], m_new);
      dequantize_by_gathers(vc + first, n, unsigned_map, leaf.v_scales[j], v_new);
    }
    __m512i m_largest = _mm512_setzero_si512(), v_largest = _mm512_setzero_si512();
    // Steps 16 values of block j from value i.
    const auto step16 = [&](int64_t i, __mmask16 lanes) OPTAX_HYBRID_AVX512_ATTRIBUTES {
      prefetch_ahead(g + first + i);
      if constexpr (kDecoupled || kL2 || kWriteParams) prefetch_ahead(p + first + i);
      if ((i & 63) == 0) {
        prefetch_ahead(mc + first + i);
        prefetch_ahead(vc + first + i);
      }
      __m512 gi = load16(g + first + i, lanes);
      __m512 pi = _mm512_setzero_ps();
      if constexpr (kDecoupled || kL2 || kWriteParams) pi = load16(p + first + i, lanes);
      if constexpr (kL2) gi = _mm512_add_ps(gi, _mm512_mul_ps(wd, pi));
      // Lanes outside `lanes` hold map[0] * scale, and stay out of the largest magnitudes.
      const __m512 m_old = _mm512_load_ps(m_new + i);
      const __m512 v_old = _mm512_load_ps(v_new + i);
      const __m512 mi = _mm512_add_ps(_mm512_mul_ps(b1, m_old), _mm512_mul_ps(one_minus_b1, gi));
      const __m512 vi = _mm512_add_ps(_mm512_mul_ps(b2, v_old), _mm512_mul_ps(one_minus_b2, _mm512_mul_ps(gi, gi)));
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), bc2_sqrt), eps);
      __m512 ui = _mm512_mul_ps(step, _mm512_div_ps(mi, denom));
      if constexpr (kDecoupled) ui = _mm512_sub_ps(ui, _mm512_mul_ps(lr_wd, pi));
      _mm512_store_ps(m_new + i, mi);
      _mm512_store_ps(v_new + i, vi);
      m_largest = _mm512_mask_max_epu32(m_largest, lanes, m_largest,
                                        _mm512_and_si512(_mm512_castps_si512(mi), magnitude));
      v_largest = _mm512_mask_max_epu32(v_largest, lanes, v_largest,
                                        _mm512_and_si512(_mm512_castps_si512(vi), magnitude));
      store16(out + first + i, lanes, kWriteParams ? _mm512_add_ps(pi, ui) : ui);
    };
    // Writes the codes of 16 values of the pending block from value i.
    const auto quantize16 = [&](int64_t i, __mmask16 lanes) OPTAX_HYBRID_AVX512_ATTRIBUTES {
      const __m512 mq = _mm512_mul_ps(_mm512_load_ps(pending_m + i), pending_m_factor);
      const __m512 vq = _mm512_mul_ps(_mm512_load_ps(pending_v + i), pending_v_factor);
      _mm512_mask_cvtepi32_storeu_epi8(pending_mc + i, lanes, m_table.codes(mq));
      _mm512_mask_cvtepi32_storeu_epi8(pending_vc + i, lanes, v_table.codes(vq));
    };
    const int64_t both_full = std::min(n, pending_n) & ~int64_t{15};
    int64_t i = 0;
    for (; i < both_full; i += 16) {  // the common case: no lane masks to compute
      step16(i, static_cast<__mmask16>(0xffff));
      quantize16(i, static_cast<__mmask16>(0xffff));
    }
    for (; i < std::max(n, pending_n); i += 16) {
      if (i < n) step16(i, lanes_below(n - i));
      if (i < pending_n) quantize16(i, lanes_below(pending_n - i));
    }
    pending_n = 0;
    if (n > 0) {
      const uint32_t m_top = _mm512_reduce_max_epu32(m_largest), v_top = _mm512_reduce_max_epu32(v_largest);
      leaf.m_scales[j] = float_of(m_top);
      leaf.v_scales[j] = float_of(v_top);
      if (tables && by_reciprocal(m_top) && by_reciprocal(v_top)) {
        pending_n = n;
        pending_m = m_new;
        pending_v = v_new;
        pending_mc = mc + first;
        pending_vc = vc + first;
        pending_m_factor = _mm512_set1_ps(reciprocal_of_scale(m_top));
        pending_v_factor = _mm512_set1_ps(reciprocal_of_scale(v_top));
      } else {  // huge, infinite or NaN scales: the scalar loops (NaN takes code 0 there)
        quantize_block(m_new, n, mc + first, m_search, m_top);
        quantize_block(v_new, n, vc + first, v_search, v_top);
      }
    }
  }
}

#define OPTAX_HYBRID_AND_VBMI , vbmi  // the EXTRA argument of the two macros above
template <typename T, typename U, bool kWriteParams>
OPTAX_HYBRID_AVX512 void run_quantized_leaf_typed_avx512(const Leaf& leaf, int64_t begin, int64_t end,
                                                         const Scalars& s, bool adamw, bool vbmi) {
  OPTAX_HYBRID_QUANTIZED_RULE(step_blocks_avx512, OPTAX_HYBRID_AND_VBMI)
}

// The AVX-512 copies' per-chunk body: run_leaf, but its own loops for 8-bit moments.
template <bool kWriteParams>
OPTAX_HYBRID_AVX512 bool run_leaf_avx512(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s,
                                         bool adamw, bool vbmi) {
  if (leaf.s == Kind::kU8) {
    OPTAX_HYBRID_QUANTIZED_DTYPES(run_quantized_leaf_typed_avx512, OPTAX_HYBRID_AND_VBMI)
    return false;
  }
  return run_leaf<kWriteParams>(leaf, begin, end, s, adamw);
}
template <bool kWriteParams>
OPTAX_HYBRID_AVX512 bool run_leaf_avx512_gathers(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s,
                                                 bool adamw) {
  return run_leaf_avx512<kWriteParams>(leaf, begin, end, s, adamw, false);
}
template <bool kWriteParams>
OPTAX_HYBRID_AVX512 bool run_leaf_avx512_permutes(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s,
                                                  bool adamw) {
  return run_leaf_avx512<kWriteParams>(leaf, begin, end, s, adamw, true);
}

// The 8-bit loops with AVX2 (8 lanes, gathers for both lookups), for the AVX2
// copy: like the AVX-512 ones, minus the lane masks (a block's last n % 8
// values take the portable per-value code) and the overlap of one block's
// codes with the next block's step.
#define OPTAX_HYBRID_AVX2_ATTRIBUTES __attribute__((target("avx2,fma,f16c"), always_inline))
#define OPTAX_HYBRID_AVX2 inline OPTAX_HYBRID_AVX2_ATTRIBUTES

OPTAX_HYBRID_AVX2 __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
OPTAX_HYBRID_AVX2 __m256 load8(const BF16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
OPTAX_HYBRID_AVX2 __m256 load8(const F16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
OPTAX_HYBRID_AVX2 void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
OPTAX_HYBRID_AVX2 void store8(BF16* p, __m256 x) {  // as from_f32<BF16>: nearest even, NaN kept quiet
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i halves = _mm256_blendv_epi8(rounded, quiet, nan);  // 16-bit values in 32-bit lanes
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(halves, halves), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
OPTAX_HYBRID_AVX2 void store8(F16* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The low bytes of 8 lanes, stored as 8 consecutive bytes.
OPTAX_HYBRID_AVX2 void store_low_bytes8(uint8_t* p, __m256i x) {
  const __m256i gathered = _mm256_shuffle_epi8(
      x, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                          -1, -1, -1, -1, -1, -1, -1, -1));
  const __m128i bytes = _mm_unpacklo_epi32(_mm256_castsi256_si128(gathered), _mm256_extracti128_si256(gathered, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), bytes);
}

OPTAX_HYBRID_AVX2 uint32_t largest_lane(__m256i x) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// CodeSearch's table on 8 values at a time (CodeTable16 with AVX2).
struct CodeTable8 {
  const int32_t* at_zero;
  __m128i shift;
  __m256i position_bits;

  OPTAX_HYBRID_AVX2 explicit CodeTable8(const CodeSearch& cs)
      : at_zero(cs.at_zero),
        shift(_mm_cvtsi32_si128(static_cast<int>(cs.shift))),
        position_bits(_mm256_set1_epi32(static_cast<int>(((1u << cs.shift) - 1) << 8))) {}

  OPTAX_HYBRID_AVX2 __m256i codes(__m256 q) const {
    const __m256i u = _mm256_castps_si256(q);
    const __m256i entry = _mm256_i32gather_epi32(at_zero, _mm256_sra_epi32(u, shift), 4);
    const __m256i position = _mm256_and_si256(_mm256_xor_si256(_mm256_slli_epi32(u, 8), _mm256_srai_epi32(u, 31)),
                                              position_bits);
    // Unsigned position > entry, as a signed comparison of both with the top bit flipped.
    const __m256i top = _mm256_set1_epi32(static_cast<int>(0x80000000u));
    const __m256i above = _mm256_cmpgt_epi32(_mm256_xor_si256(position, top), _mm256_xor_si256(entry, top));
    return _mm256_sub_epi32(entry, above);  // below + 1 where above (its lanes hold -1)
  }
};

template <typename T, typename U, bool kDecoupled, bool kL2, bool kWriteParams>
OPTAX_HYBRID_AVX2 void step_blocks_avx2(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s) {
  alignas(32) float m_new[kMaxBlock];
  alignas(32) float v_new[kMaxBlock];
  const auto* g = static_cast<const T*>(leaf.g);
  auto* mc = static_cast<uint8_t*>(leaf.m);
  auto* vc = static_cast<uint8_t*>(leaf.v);
  const auto* p = static_cast<const T*>(leaf.p);
  auto* out = static_cast<U*>(leaf.out);
  const QuantTables& q = *leaf.tables;
  const bool tables = q.signed_search->shift != 0 && q.unsigned_search->shift != 0;
  const CodeTable8 m_table(*q.signed_search), v_table(*q.unsigned_search);
  const StepConstants c(s);
  const __m256 b1 = _mm256_set1_ps(c.b1), one_minus_b1 = _mm256_set1_ps(c.one_minus_b1);
  const __m256 b2 = _mm256_set1_ps(c.b2), one_minus_b2 = _mm256_set1_ps(c.one_minus_b2);
  const __m256 bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 step = _mm256_set1_ps(c.step), wd = _mm256_set1_ps(c.wd), lr_wd = _mm256_set1_ps(c.lr_wd);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  for (int64_t j = begin; j < end; ++j) {
    const BlockAt at = block_at(leaf, j);
    const int64_t first = at.first_value, n = at.n, full = n & ~int64_t{7};
    const __m256 m_scale = _mm256_set1_ps(leaf.m_scales[j]), v_scale = _mm256_set1_ps(leaf.v_scales[j]);
    __m256i m_largest = _mm256_setzero_si256(), v_largest = _mm256_setzero_si256();
    for (int64_t i = 0; i < full; i += 8) {
      if ((i & 15) == 0) {
        prefetch_ahead(g + first + i);
        if constexpr (kDecoupled || kL2 || kWriteParams) prefetch_ahead(p + first + i);
      }
      if ((i & 63) == 0) {
        prefetch_ahead(mc + first + i);
        prefetch_ahead(vc + first + i);
      }
      __m256 gi = load8(g + first + i);
      __m256 pi = _mm256_setzero_ps();
      if constexpr (kDecoupled || kL2 || kWriteParams) pi = load8(p + first + i);
      if constexpr (kL2) gi = _mm256_add_ps(gi, _mm256_mul_ps(wd, pi));
      const __m256i m_code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mc + first + i)));
      const __m256i v_code = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(vc + first + i)));
      const __m256 m_old = _mm256_mul_ps(_mm256_i32gather_ps(q.signed_map, m_code, 4), m_scale);
      const __m256 v_old = _mm256_mul_ps(_mm256_i32gather_ps(q.unsigned_map, v_code, 4), v_scale);
      const __m256 mi = _mm256_add_ps(_mm256_mul_ps(b1, m_old), _mm256_mul_ps(one_minus_b1, gi));
      const __m256 vi = _mm256_add_ps(_mm256_mul_ps(b2, v_old), _mm256_mul_ps(one_minus_b2, _mm256_mul_ps(gi, gi)));
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2_sqrt), eps);
      __m256 ui = _mm256_mul_ps(step, _mm256_div_ps(mi, denom));
      if constexpr (kDecoupled) ui = _mm256_sub_ps(ui, _mm256_mul_ps(lr_wd, pi));
      _mm256_store_ps(m_new + i, mi);
      _mm256_store_ps(v_new + i, vi);
      m_largest = _mm256_max_epu32(m_largest, _mm256_and_si256(_mm256_castps_si256(mi), magnitude));
      v_largest = _mm256_max_epu32(v_largest, _mm256_and_si256(_mm256_castps_si256(vi), magnitude));
      store8(out + first + i, kWriteParams ? _mm256_add_ps(pi, ui) : ui);
    }
    uint32_t m_top = largest_lane(m_largest), v_top = largest_lane(v_largest);
    for (int64_t i = full; i < n; ++i) {  // the block's last n % 8 values
      float pi = 0.0f;
      if constexpr (kDecoupled || kL2 || kWriteParams) pi = to_f32(p[first + i]);
      const ValueStep r = step_value<kDecoupled, kL2, kWriteParams>(
          to_f32(g[first + i]), pi, q.signed_map[mc[first + i]] * leaf.m_scales[j],
          q.unsigned_map[vc[first + i]] * leaf.v_scales[j], c);
      m_new[i] = r.m;
      v_new[i] = r.v;
      m_top = std::max(m_top, bits_of(r.m) & 0x7fffffffu);
      v_top = std::max(v_top, bits_of(r.v) & 0x7fffffffu);
      out[first + i] = from_f32<U>(r.first);
    }
    leaf.m_scales[j] = float_of(m_top);
    leaf.v_scales[j] = float_of(v_top);
    // Whole groups of 8 by vector, the rest (all of a block with huge,
    // infinite or NaN scales, or without tables) by the scalar loops.
    int64_t vector_values = 0;
    if (tables && by_reciprocal(m_top) && by_reciprocal(v_top)) {
      const __m256 m_factor = _mm256_set1_ps(reciprocal_of_scale(m_top));
      const __m256 v_factor = _mm256_set1_ps(reciprocal_of_scale(v_top));
      for (int64_t i = 0; i < full; i += 8) {
        store_low_bytes8(mc + first + i, m_table.codes(_mm256_mul_ps(_mm256_load_ps(m_new + i), m_factor)));
        store_low_bytes8(vc + first + i, v_table.codes(_mm256_mul_ps(_mm256_load_ps(v_new + i), v_factor)));
      }
      vector_values = full;
    }
    const int64_t i = vector_values;
    quantize_block(m_new + i, n - i, mc + first + i, *q.signed_search, m_top);
    quantize_block(v_new + i, n - i, vc + first + i, *q.unsigned_search, v_top);
  }
}

template <typename T, typename U, bool kWriteParams>
OPTAX_HYBRID_AVX2 void run_quantized_leaf_typed_avx2(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s,
                                                     bool adamw) {
  OPTAX_HYBRID_QUANTIZED_RULE(step_blocks_avx2, )
}

// The AVX2 copy's per-chunk body: run_leaf, but its own loops for 8-bit moments.
template <bool kWriteParams>
OPTAX_HYBRID_AVX2 bool run_leaf_avx2(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw) {
  if (leaf.s == Kind::kU8) {
    OPTAX_HYBRID_QUANTIZED_DTYPES(run_quantized_leaf_typed_avx2, )
    return false;
  }
  return run_leaf<kWriteParams>(leaf, begin, end, s, adamw);
}
#endif

// ---------------------------------------------------------------------------
// Instruction sets. The chunk body is compiled once per instruction set, each
// copy a function with its own `target` attribute, and one copy is chosen when
// the library loads: the widest this CPU runs, or the one named by the
// environment variable OPTAX_HYBRID_NATIVE_ISA (auto, avx512vbmi, avx512, avx2,
// baseline).
// The rest of the library is built for the architecture's baseline (setup.py
// passes no -march), so a wheel built on one machine runs on any other.

using ChunkFn = bool (*)(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw,
                         bool write_params);

#define OPTAX_HYBRID_CHUNK_FOR_ISA(NAME, RUN_LEAF, TARGET_ATTRIBUTE)                                 \
  TARGET_ATTRIBUTE bool NAME(const Leaf& leaf, int64_t begin, int64_t end, const Scalars& s, bool adamw, \
                             bool write_params) {                                                  \
    return write_params ? RUN_LEAF<true>(leaf, begin, end, s, adamw)                               \
                        : RUN_LEAF<false>(leaf, begin, end, s, adamw);                             \
  }

OPTAX_HYBRID_CHUNK_FOR_ISA(run_chunk_baseline, run_leaf, )

struct IsaVariant {
  const char* name;
  ChunkFn run_chunk;
  bool (*cpu_runs_it)();
};

#if defined(__x86_64__) || defined(__i386__)
// F16C (float16 conversions) and FMA come with every AVX2 and AVX-512 CPU;
// they are listed so that the compiler may use them.
OPTAX_HYBRID_CHUNK_FOR_ISA(run_chunk_avx2, run_leaf_avx2, __attribute__((target("avx2,fma,f16c"))))
OPTAX_HYBRID_CHUNK_FOR_ISA(run_chunk_avx512, run_leaf_avx512_gathers,
                           __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))))
// The same loops; 8-bit moments dequantized by byte permutes (VBMI: Ice Lake,
// Zen 4 and later) instead of gathers, which cost more and whose speed varies
// with what else the core runs.
OPTAX_HYBRID_CHUNK_FOR_ISA(run_chunk_avx512vbmi, run_leaf_avx512_permutes,
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
bool cpu_runs_avx512vbmi() { return cpu_runs_avx512() && __builtin_cpu_supports("avx512vbmi"); }
#endif
bool cpu_runs_baseline() { return true; }

// Widest first: "auto" takes the first one the CPU runs.
constexpr IsaVariant kIsaVariants[] = {
#if defined(__x86_64__) || defined(__i386__)
    {"avx512vbmi", run_chunk_avx512vbmi, cpu_runs_avx512vbmi},
    {"avx512", run_chunk_avx512, cpu_runs_avx512},
    {"avx2", run_chunk_avx2, cpu_runs_avx2},
#endif
    {"baseline", run_chunk_baseline, cpu_runs_baseline},
};

constexpr char kIsaVariable[] = "OPTAX_HYBRID_NATIVE_ISA";

struct IsaChoice {
  const IsaVariant* variant = nullptr;  // nullptr: the variable names no variant this CPU runs
  char cpu_runs[96] = "";               // the variants this CPU runs, widest first, space-separated
  char problem[512] = "";
};

IsaChoice choose_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();  // this may run before libgcc's own initializer
#endif
  IsaChoice choice;
  char names[96] = "";  // every variant of this build, for the message
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

// The step's scalars, checked: lr, b1, b2, eps, wd, bias corrections, then the skip flag.
ffi::Error read_scalars(const ffi::Buffer<ffi::F32>& scalars, Scalars* s) {
  if (scalars.element_count() != 8) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: expected 8 scalars");
  }
  const float* sc = scalars.typed_data();
  *s = Scalars{sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], sc[7] != 0.0f};
  return ffi::Error::Success();
}

// The code tables, rows: signed map, unsigned map, signed thresholds,
// unsigned thresholds (native_cpu.py: CODE_TABLES); read only when a leaf is 8-bit.
ffi::Error read_tables(const ffi::Buffer<ffi::F32>& code_tables, int32_t block_size, bool any_quantized,
                       QuantTables* tables) {
  if (code_tables.element_count() != 4 * kCodes) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: expected 4 x 256 code tables");
  }
  if (!any_quantized) return ffi::Error::Success();
  if (block_size < 1 || block_size > kMaxBlock) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: block size out of range");
  }
  const float* t = code_tables.typed_data();
  *tables = QuantTables{t, t + kCodes, &search_for(t + 2 * kCodes), &search_for(t + 3 * kCodes), byte_planes(t),
                        byte_planes(t + kCodes)};
  return ffi::Error::Success();
}

// Where one leaf's moment arrays are, in order: mu and nu, or for 8-bit
// moments mu's codes and scales then nu's.
struct Moments {
  void* data[4] = {nullptr, nullptr, nullptr, nullptr};
  Kind kind[4] = {Kind::kOther, Kind::kOther, Kind::kOther, Kind::kOther};
  int64_t count[4] = {0, 0, 0, 0};
};

// One leaf of a call, checked: its gradient's buffer, its moments, its param
// (nullptr when not read) and its first result (the update, or the new param).
ffi::Error make_leaf(const ffi::AnyBuffer& g, const Moments& mo, void* p, void* first, ffi::DataType first_type,
                     bool quantized_leaf, bool decay, bool write_params, int32_t block_size,
                     const QuantTables* tables, Leaf* leaf) {
  if ((write_params || decay) && p == nullptr) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: this leaf needs its param");
  }
  const int64_t n = static_cast<int64_t>(g.element_count());
  const int v_at = quantized_leaf ? 2 : 1;
  if (mo.kind[0] != mo.kind[v_at]) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: mu and nu dtypes differ");
  }
  if (mo.count[0] != n || mo.count[v_at] != n) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: a moment's size differs from its gradient's");
  }
  *leaf = Leaf{g.untyped_data(), mo.data[0], mo.data[v_at], p, first, n, kind_of(g.element_type()), mo.kind[0],
               kind_of(first_type), decay};
  if (!quantized_leaf) return ffi::Error::Success();
  // Codes shaped like the leaf, float32 scales (..., ceil(row / block)).
  const auto dims = g.dimensions();
  if (dims.size() == 0 || mo.kind[0] != Kind::kU8 || mo.kind[1] != Kind::kF32 || mo.kind[3] != Kind::kF32) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: 8-bit moments need uint8 codes shaped like the "
                                       "leaf and float32 scales");
  }
  leaf->row = dims.back();
  leaf->block = block_size;
  leaf->blocks_per_row = (leaf->row + block_size - 1) / block_size;
  if (leaf->row == 0 || mo.count[1] != n / leaf->row * leaf->blocks_per_row || mo.count[3] != mo.count[1]) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: 8-bit moment scales of the wrong size");
  }
  leaf->m_scales = static_cast<float*>(mo.data[1]);
  leaf->v_scales = static_cast<float*>(mo.data[3]);
  leaf->tables = tables;
  return ffi::Error::Success();
}

// Steps every leaf: chunks spread over the calling thread and XLA's pool.
ffi::Error run_leaves(ffi::ThreadPool& pool, const std::vector<Leaf>& leaves, const Scalars& s, bool adamw,
                      bool write_params) {
  auto sh = std::make_shared<Shared>();
  for (size_t i = 0; i < leaves.size(); ++i) {
    const int64_t items = leaves[i].work_items();
    const int64_t per_chunk = std::max<int64_t>(1, kChunk / leaves[i].values_per_item());
    for (int64_t b = 0; b < items; b += per_chunk) {
      sh->chunks.push_back(Chunk{static_cast<int32_t>(i), b, std::min(items, b + per_chunk)});
    }
  }
  const int64_t total = static_cast<int64_t>(sh->chunks.size());
  if (total == 0) return ffi::Error::Success();

  auto run = [&leaves, &s, adamw, write_params, run_chunk = kIsa.variant->run_chunk](Shared& shared) {
    work(shared, leaves, s, adamw, write_params, run_chunk);
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

// A call's scalars, and its code tables when some leaf is 8-bit.
ffi::Error read_constants(const ffi::Buffer<ffi::F32>& scalars, const ffi::Buffer<ffi::F32>& code_tables,
                          int32_t block_size, ffi::Span<const int32_t> quantized, Scalars* s, QuantTables* tables) {
  if (auto e = read_scalars(scalars, s); e.failure()) return e;
  const bool any_quantized = std::any_of(quantized.begin(), quantized.end(), [](int32_t q) { return q != 0; });
  return read_tables(code_tables, block_size, any_quantized, tables);
}

// A result updated in place: copied in first when XLA did not alias it.
void* in_place(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  if (out->untyped_data() != in.untyped_data()) std::memcpy(out->untyped_data(), in.untyped_data(), in.size_bytes());
  return out->untyped_data();
}

// Every leaf in its own buffers: per leaf the gradient, mu's array(s), nu's,
// the param if read; per leaf the first result and the moments' results.
ffi::Error AdamWImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::F32> code_tables,
                     ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t adamw_mode, int32_t write_params,
                     int32_t block_size, ffi::Span<const int32_t> decay, ffi::Span<const int32_t> has_param,
                     ffi::Span<const int32_t> quantized) {
  if (kIsa.variant == nullptr) return ffi::Error::InvalidArgument(kIsa.problem);
  const size_t n_leaves = decay.size();
  size_t n_rets = 0;
  for (size_t i = 0; i < quantized.size(); ++i) n_rets += quantized[i] ? 5 : 3;
  if (has_param.size() != n_leaves || quantized.size() != n_leaves || rets.size() != n_rets) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw: inconsistent leaf counts");
  }
  Scalars s;
  QuantTables tables{};
  if (auto e = read_constants(scalars, code_tables, block_size, quantized, &s, &tables); e.failure()) return e;

  std::vector<Leaf> leaves(n_leaves);
  size_t arg = 0, ret = 0;
  for (size_t i = 0; i < n_leaves; ++i) {
    const bool quantized_leaf = quantized[i] != 0;
    const size_t n_arrays = quantized_leaf ? 4 : 2;  // mu's codes and scales then nu's, or mu and nu
    auto g = args.get<ffi::AnyBuffer>(arg++);
    if (!g.has_value()) return ffi::Error::InvalidArgument("optax_hybrid adamw: missing leaf operand");
    std::vector<ffi::AnyBuffer> moments;
    for (size_t k = 0; k < n_arrays; ++k) {
      auto x = args.get<ffi::AnyBuffer>(arg++);
      if (!x.has_value()) return ffi::Error::InvalidArgument("optax_hybrid adamw: missing leaf operand");
      moments.push_back(*x);
    }
    void* p = nullptr;
    if (has_param[i]) {
      auto pb = args.get<ffi::AnyBuffer>(arg++);
      if (!pb.has_value()) return ffi::Error::InvalidArgument("optax_hybrid adamw: missing param");
      p = pb->untyped_data();
    }
    auto out = rets.get<ffi::AnyBuffer>(ret++);
    if (!out.has_value()) return ffi::Error::InvalidArgument("optax_hybrid adamw: missing result");
    Moments mo;
    for (size_t k = 0; k < n_arrays; ++k) {
      auto x = rets.get<ffi::AnyBuffer>(ret++);
      if (!x.has_value()) return ffi::Error::InvalidArgument("optax_hybrid adamw: missing result");
      if ((*x)->size_bytes() != moments[k].size_bytes()) {
        return ffi::Error::InvalidArgument("optax_hybrid adamw: a moment result differs from its operand");
      }
      mo.data[k] = in_place(moments[k], *x);
      mo.kind[k] = kind_of(moments[k].element_type());
      mo.count[k] = static_cast<int64_t>(moments[k].element_count());
    }
    if (auto e = make_leaf(*g, mo, p, (*out)->untyped_data(), (*out)->element_type(), quantized_leaf, decay[i] != 0,
                           write_params != 0, block_size, &tables, &leaves[i]);
        e.failure()) {
      return e;
    }
  }
  return run_leaves(pool, leaves, s, adamw_mode != 0, write_params != 0);
}

// The moments of every leaf packed into a few flat buffers ("pools", the last
// n_pools operands, each updated in place: result k of the pools aliases
// operand k). Leaf i's slot k (0: mu's values or codes, 1: mu's scales, 2: nu's
// values or codes, 3: nu's scales) is pool slot_pool[4 i + k] from element
// slot_offset[4 i + k] (pool -1 for a float leaf's scales). Operands: per leaf
// the gradient, then the param if read (has_param). Results: per leaf its
// first result (the update, or the new param, aliased to the param by the
// caller), then the pools.
constexpr int kSlots = 4;

ffi::Error AdamWPackedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::F32> code_tables,
                           ffi::RemainingArgs args, ffi::RemainingRets rets, int32_t adamw_mode,
                           int32_t write_params, int32_t block_size, ffi::Span<const int32_t> decay,
                           ffi::Span<const int32_t> has_param, ffi::Span<const int32_t> quantized,
                           int32_t n_pools, ffi::Span<const int32_t> slot_pool,
                           ffi::Span<const int64_t> slot_offset) {
  if (kIsa.variant == nullptr) return ffi::Error::InvalidArgument(kIsa.problem);
  const size_t n_leaves = decay.size();
  const size_t n_params = std::count_if(has_param.begin(), has_param.end(), [](int32_t h) { return h != 0; });
  if (has_param.size() != n_leaves || quantized.size() != n_leaves || slot_pool.size() != kSlots * n_leaves ||
      slot_offset.size() != kSlots * n_leaves || n_pools < 0 || args.size() != n_leaves + n_params + n_pools ||
      rets.size() != n_leaves + n_pools) {
    return ffi::Error::InvalidArgument("optax_hybrid adamw packed: inconsistent leaf or pool counts");
  }
  Scalars s;
  QuantTables tables{};
  if (auto e = read_constants(scalars, code_tables, block_size, quantized, &s, &tables); e.failure()) return e;

  // The pools, in place.
  std::vector<char*> pool_data(n_pools);
  std::vector<Kind> pool_kind(n_pools);
  std::vector<int64_t> pool_count(n_pools), pool_item(n_pools);
  for (int32_t k = 0; k < n_pools; ++k) {
    auto in = args.get<ffi::AnyBuffer>(n_leaves + n_params + k);
    auto out = rets.get<ffi::AnyBuffer>(n_leaves + k);
    if (!in.has_value() || !out.has_value() || (*out)->size_bytes() != in->size_bytes()) {
      return ffi::Error::InvalidArgument("optax_hybrid adamw packed: a pool's result differs from its operand");
    }
    pool_data[k] = static_cast<char*>(in_place(*in, *out));
    pool_kind[k] = kind_of(in->element_type());
    pool_count[k] = static_cast<int64_t>(in->element_count());
    pool_item[k] = pool_count[k] == 0 ? 1 : static_cast<int64_t>(in->size_bytes()) / pool_count[k];
  }

  std::vector<Leaf> leaves(n_leaves);
  size_t arg = 0;
  for (size_t i = 0; i < n_leaves; ++i) {
    auto g = args.get<ffi::AnyBuffer>(arg++);
    void* p = nullptr;
    if (has_param[i]) {
      auto pb = args.get<ffi::AnyBuffer>(arg++);
      if (!pb.has_value()) return ffi::Error::InvalidArgument("optax_hybrid adamw packed: missing param");
      p = pb->untyped_data();
    }
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!g.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("optax_hybrid adamw packed: missing gradient or result");
    }
    const bool quantized_leaf = quantized[i] != 0;
    const int64_t n = static_cast<int64_t>(g->element_count());
    const auto dims = g->dimensions();
    const int64_t row = dims.size() == 0 ? 1 : dims.back();
    const int64_t n_scales = row == 0 || block_size < 1 ? 0 : n / row * ((row + block_size - 1) / block_size);
    Moments mo;
    const int n_arrays = quantized_leaf ? 4 : 2;  // mu's codes and scales then nu's, or mu and nu
    for (int k = 0; k < n_arrays; ++k) {
      const int slot = quantized_leaf ? k : 2 * k;
      const int32_t at = slot_pool[kSlots * i + slot];
      const int64_t offset = slot_offset[kSlots * i + slot];
      const int64_t count = slot % 2 == 1 ? n_scales : n;
      if (at < 0 || at >= n_pools || offset < 0 || offset + count > pool_count[at]) {
        return ffi::Error::InvalidArgument("optax_hybrid adamw packed: a moment outside its pool");
      }
      mo.data[k] = pool_data[at] + offset * pool_item[at];
      mo.kind[k] = pool_kind[at];
      mo.count[k] = count;
    }
    if (auto e = make_leaf(*g, mo, p, (*out)->untyped_data(), (*out)->element_type(), quantized_leaf, decay[i] != 0,
                           write_params != 0, block_size, &tables, &leaves[i]);
        e.failure()) {
      return e;
    }
  }
  return run_leaves(pool, leaves, s, adamw_mode != 0, write_params != 0);
}

}  // namespace

namespace {

// What both calls take, in this order; the packed call adds its pools' attributes.
auto adamw_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::Buffer<ffi::F32>>()  // scalars
      .Arg<ffi::Buffer<ffi::F32>>()  // code tables
      .RemainingArgs()
      .RemainingRets()
      .Attr<int32_t>("adamw_mode")
      .Attr<int32_t>("write_params")
      .Attr<int32_t>("block_size")
      .Attr<ffi::Span<const int32_t>>("decay")
      .Attr<ffi::Span<const int32_t>>("has_param")
      .Attr<ffi::Span<const int32_t>>("quantized");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxHybridAdamWCpu, AdamWImpl, adamw_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OptaxHybridAdamWPackedCpu, AdamWPackedImpl,
                              adamw_binding()
                                  .Attr<int32_t>("n_pools")
                                  .Attr<ffi::Span<const int32_t>>("slot_pool")
                                  .Attr<ffi::Span<const int64_t>>("slot_offset"));

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
