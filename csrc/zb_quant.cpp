// Blockwise int8 / int4 / int2 quantization kernels for zb's all-reduce, registered as torch.ops.zb.*,
// and the sparse top-k scheme's (sparse_compress, sparse_decode_add: see "Sparse top-k" below).
//
// Schemes (the pure-PyTorch twins in zb/collectives/twins.py define the exact meaning), per block of
// `block` values (the last may be shorter), L = 2^(bits - 1) - 1 levels each side of zero:
//   int8 (L = 127), int4 (L = 7): m = max |x|; scale = m / L; inv = L / m (fp32 divisions).
//   int2 (L = 1): a = |x_0| + |x_1| + ... in index order; scale = (a / count) * 2; inv = 1 / scale.
//   code = clamp(round_half_even(x * inv), -L, L) + L; value = (code - L) * scale.
//   A block with a NaN or Inf (int2: a non-finite scale) gets scale = NaN (every value of it
//   dequantizes to NaN), a block with m (int2: scale) < 2^-100 gets scale = 0; both get code L.
// Packing, little-endian: int8 one code per byte (stored as code + 1, the historical [1, 255]),
// int4 two per byte (value i in bits 4 (i % 2)), int2 four (value i in bits 2 (i % 4)); the unused
// high bits of the last byte are zero. Any block size works: a byte may straddle two blocks.
// Error feedback (`residual`): quantize sends t = x + r and keeps r = t - value; reduce_quantize
// sends t = (acc + r + in) / d and keeps r = (acc + r + in) - value * d.
// Every step is one separately rounded IEEE operation. Build with -ffp-contract=off and without
// -ffast-math so that this file, its twin and any CPU produce the same bits.
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <thread>
#include <utility>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

// Per-block bodies are inlined into their loops over blocks, whose invariants then stay in registers.
#if defined(__GNUC__) || defined(__clang__)
#define ZB_INLINE __attribute__((always_inline))
#define ZB_PREFETCH_WRITE(p) __builtin_prefetch((p), 1)
inline int lowest_bit(uint64_t w) { return __builtin_ctzll(w); }  // w != 0
inline int highest_bit(uint64_t w) { return 63 - __builtin_clzll(w); }  // w != 0
inline int bit_count(uint64_t w) { return __builtin_popcountll(w); }
#else
#define ZB_INLINE
#define ZB_PREFETCH_WRITE(p) ((void)(p))
inline int lowest_bit(uint64_t w) {
  int b = 0;
  for (; (w & 1u) == 0; w >>= 1) ++b;
  return b;
}
inline int highest_bit(uint64_t w) {
  int b = 63;
  for (; (w >> 63) == 0; w <<= 1) --b;
  return b;
}
inline int bit_count(uint64_t w) {
  int n = 0;
  for (; w != 0; w &= w - 1) ++n;
  return n;
}
#endif

namespace {

constexpr uint32_t kInfBits = 0x7f800000u;   // |x| bits at or above this: Inf or NaN
constexpr uint32_t kTinyBits = 0x0d800000u;  // 2^-100: below it L/m could overflow
constexpr float kTiny = 0x1p-100f;           // 2^-100, the same bound for int2's scale
constexpr float kMagic = 12582912.0f;        // 1.5 * 2^23: (y + M) - M rounds half to even
constexpr float kInt2MeanScale = 2.0f;       // int2's scale over the block's mean |x| (twins.INT2_MEAN_SCALE)
constexpr int64_t kGrainValues = 1 << 15;    // values per parallel task
constexpr int64_t kMaxStackBlock = 4096;     // reduce_quantize's buffer (a group's values) on the stack

// The per-width constants. kOffset is what a stored code minus the value's level is: L, except
// int8, whose bytes keep the historical code + 1 (in [1, 255], 128 for zero).
template <int kBits>
struct Width {
  static constexpr int kPer = 8 / kBits;                    // codes per byte
  static constexpr int kLevels = (1 << (kBits - 1)) - 1;    // L
  static constexpr int kOffset = kBits == 8 ? 128 : kLevels;
  static constexpr uint32_t kMask = (1u << kBits) - 1u;
  static constexpr bool kMeanScale = kBits == 2;
  // A byte of kPer zero codes, for special blocks.
  static constexpr uint8_t kZeroByte = kBits == 8 ? 0x80 : kBits == 4 ? 0x77 : 0x55;
};

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

// Max of |x| as bit patterns: for non-NaN floats the order of (bits & 0x7fffffff) is the order
// of magnitudes, NaNs sort above Inf, and an integer max reduction vectorizes without fast-math.
inline uint32_t absmax_bits(const float* __restrict x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, x + i, sizeof(b));
    b &= 0x7fffffffu;
    m = b > m ? b : m;
  }
  return m;
}

inline float abs_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return bits_to_float(b & 0x7fffffffu);
}

// |x_0| + |x_1| + ... one fp32 addition at a time, in index order (no reassociation: the twin's
// order). A single chain is bound by the addition's latency, so `lanes` blocks of `len` values,
// `stride` apart, are summed side by side: each lane is still its own block's sequential sum.
template <int kLanes>
inline void abs_sums(const float* __restrict x, int64_t stride, int64_t len, float* __restrict out) {
  float a[kLanes];
  for (int j = 0; j < kLanes; ++j) a[j] = 0.0f;
  for (int64_t i = 0; i < len; ++i) {
    for (int j = 0; j < kLanes; ++j) a[j] = a[j] + abs_bits(x[j * stride + i]);
  }
  for (int j = 0; j < kLanes; ++j) out[j] = a[j];
}

// Scale and inv (0 for a special block: all codes zero) from an absmax block's max |x| bits.
template <int kBits>
inline float absmax_scale(uint32_t mbits, float* inv) {
  constexpr float kL = static_cast<float>(Width<kBits>::kLevels);
  *inv = 0.0f;
  if (mbits >= kInfBits) return std::numeric_limits<float>::quiet_NaN();
  if (mbits < kTinyBits) return 0.0f;
  float m = bits_to_float(mbits);
  *inv = kL / m;
  return m / kL;
}

// Scale and inv from an int2 block's sum of |x| over `count` values.
inline float mean_scale(float sum, int64_t count, float* inv) {
  float m = (sum / static_cast<float>(count)) * kInt2MeanScale;
  *inv = 0.0f;
  if (!std::isfinite(m)) return std::numeric_limits<float>::quiet_NaN();
  if (m < kTiny) return 0.0f;
  *inv = 1.0f / m;
  return m;
}

// The scale of the block of `len` values at x (int2 computes its own sum).
template <int kBits>
inline float block_scale(const float* x, int64_t len, float* inv) {
  if constexpr (Width<kBits>::kMeanScale) {
    float sum;
    abs_sums<1>(x, 0, len, &sum);
    return mean_scale(sum, len, inv);
  } else {
    return absmax_scale<kBits>(absmax_bits(x, len), inv);
  }
}

// The code (kOffset + level) of one value, for a block with inv != 0.
//  int8, int4: y = x * inv satisfies |y| <= L * (1 + 2^-24)^2 < L + 0.5 whenever |x| <= m, so
//  round(y) is in [-L, L] and needs no clamp. Adding 1.5 * 2^23 rounds y half to even and leaves
//  round(y) in the low mantissa bits: bits(y + M) = 0x4B400000 + round(y), whose low bits + kOffset
//  are the code. This avoids float->int conversions and clamps, which vectorize poorly.
//  int2: round_half_even(y) clamped to [-1, 1] is 1 above 0.5, -1 below -0.5, else 0 (|y| can be
//  large: the scale is not the block's max).
template <int kBits>
inline uint32_t code_of(float x, float inv) {
  float y = x * inv;
  if constexpr (kBits == 2) {
    return 1u + static_cast<uint32_t>(y > 0.5f) - static_cast<uint32_t>(y < -0.5f);
  } else {
    float r = y + kMagic;  // a second rounding: an FMA here would change results (-ffp-contract=off)
    uint32_t bits;
    std::memcpy(&bits, &r, sizeof(bits));
    return (bits + static_cast<uint32_t>(Width<kBits>::kOffset)) & Width<kBits>::kMask;
  }
}

// int8: one code per byte at q[i].
inline void encode8(const float* __restrict x, uint8_t* __restrict q, int64_t n, float inv) {
  if (inv == 0.0f) {
    std::memset(q, 128, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) q[i] = static_cast<uint8_t>(code_of<8>(x[i], inv));
}

// Writes the codes of the block of `len` values x[0..len) that starts at value `first` into the
// packed codes q (of the whole tensor). A byte shared with the previous block (block not a
// multiple of the codes per byte) has that block's codes in its low bits and zeros above: this
// block ORs its codes in. The block's last, partial byte is written with zeros above. Blocks are
// encoded in order within a task, and tasks start at byte boundaries (see plan()).
template <int kBits>
inline void encode(const float* __restrict x, uint8_t* __restrict q, int64_t first, int64_t len, float inv) {
  using W = Width<kBits>;
  if constexpr (kBits == 8) {
    encode8(x, q + first, len, inv);
  } else {
    constexpr int kPer = W::kPer;
    const bool special = inv == 0.0f;
    auto code = [&](int64_t i) -> uint32_t { return special ? W::kLevels : code_of<kBits>(x[i], inv); };
    int64_t head = std::min<int64_t>(len, (kPer - first % kPer) % kPer);
    for (int64_t i = 0; i < head; ++i) {
      int64_t v = first + i;
      q[v / kPer] = static_cast<uint8_t>(q[v / kPer] | (code(i) << ((v % kPer) * kBits)));
    }
    int64_t bytes = (len - head) / kPer;
    int64_t q0 = (first + head) / kPer;
    if (special) {
      std::memset(q + q0, W::kZeroByte, bytes);
    } else {
      for (int64_t j = 0; j < bytes; ++j) {
        uint32_t b = 0;
        for (int k = 0; k < kPer; ++k) b |= code_of<kBits>(x[head + kPer * j + k], inv) << (k * kBits);
        q[q0 + j] = static_cast<uint8_t>(b);
      }
    }
    int64_t done = head + bytes * kPer;
    if (done < len) {
      uint32_t b = 0;
      for (int64_t i = done; i < len; ++i) b |= code(i) << ((i - done) * kBits);
      q[(first + done) / kPer] = static_cast<uint8_t>(b);
    }
  }
}

// What decode does with each value v at out[i]: out = v, out += v, out = src + v, out -= v,
// out -= v * d (each a separately rounded IEEE operation).
enum class Op { kSet, kAdd, kAddFrom, kSub, kSubMul };

template <Op kOp>
inline void apply(float* __restrict out, const float* __restrict src, int64_t i, float v, float d) {
  if constexpr (kOp == Op::kSet) {
    out[i] = v;
  } else if constexpr (kOp == Op::kAdd) {
    out[i] = out[i] + v;
  } else if constexpr (kOp == Op::kAddFrom) {
    out[i] = src[i] + v;
  } else if constexpr (kOp == Op::kSub) {
    out[i] = out[i] - v;
  } else {
    out[i] = out[i] - v * d;  // two roundings: an FMA here would change results (-ffp-contract=off)
  }
}

template <int kBits>
inline float value_of(uint32_t code, float s) {
  return static_cast<float>(static_cast<int32_t>(code) - Width<kBits>::kOffset) * s;
}

// int8: one code per byte at q[i].
template <Op kOp>
inline void decode8(const uint8_t* __restrict q, float* __restrict out, const float* __restrict src, int64_t n,
                    float s, float d) {
  for (int64_t i = 0; i < n; ++i) apply<kOp>(out, src, i, value_of<8>(q[i], s), d);
}

// Applies the values of the block of `len` values that starts at value `first` (codes q of the
// whole tensor, scale s) to out[0..len) (src[0..len) for kAddFrom, d for kSubMul);
// value = float(code - kOffset) * s (one IEEE multiplication).
template <int kBits, Op kOp>
inline void decode(const uint8_t* __restrict q, int64_t first, int64_t len, float s, float* __restrict out,
                   float d = 1.0f, const float* __restrict src = nullptr) {
  using W = Width<kBits>;
  if constexpr (kBits == 8) {
    decode8<kOp>(q + first, out, src, len, s, d);
  } else {
    constexpr int kPer = W::kPer;
    auto at = [q](int64_t v) -> uint32_t { return (q[v / kPer] >> ((v % kPer) * kBits)) & W::kMask; };
    int64_t head = std::min<int64_t>(len, (kPer - first % kPer) % kPer);
    for (int64_t i = 0; i < head; ++i) apply<kOp>(out, src, i, value_of<kBits>(at(first + i), s), d);
    int64_t bytes = (len - head) / kPer;
    int64_t q0 = (first + head) / kPer;
    for (int64_t j = 0; j < bytes; ++j) {
      uint32_t b = q[q0 + j];
      for (int k = 0; k < kPer; ++k) {
        apply<kOp>(out, src, head + kPer * j + k, value_of<kBits>((b >> (k * kBits)) & W::kMask, s), d);
      }
    }
    for (int64_t i = head + bytes * kPer; i < len; ++i) apply<kOp>(out, src, i, value_of<kBits>(at(first + i), s), d);
  }
}

// ---------------------------------------------------------------------------------------------
// Arguments and threads

struct Blocks {
  int64_t n, block, count;
  int bits;
};

int64_t code_bytes(int64_t n, int64_t bits) { return (n * bits + 7) / 8; }

Blocks check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t block,
                  int64_t bits, int64_t threads) {
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  TORCH_CHECK(bits == 8 || bits == 4 || bits == 2, "bits must be 8, 4 or 2, got ", bits);
  TORCH_CHECK(threads >= 1, "threads must be at least 1, got ", threads);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "expected a contiguous float32 CPU tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.device().is_cpu() &&
                  codes.numel() == code_bytes(x.numel(), bits),
              "codes must be a contiguous uint8 CPU tensor of ceil(values * bits / 8) = ",
              code_bytes(x.numel(), bits), " bytes, got ", codes.numel());
  int64_t count = (x.numel() + block - 1) / block;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.device().is_cpu() &&
                  scales.numel() == count,
              "scales must be a contiguous float32 CPU tensor with one element per block (", count, "), got ",
              scales.numel());
  return {x.numel(), block, count, static_cast<int>(bits)};
}

float* residual_ptr(const c10::optional<at::Tensor>& residual, int64_t n) {
  if (!residual.has_value()) return nullptr;
  const at::Tensor& r = *residual;
  TORCH_CHECK(r.scalar_type() == at::kFloat && r.is_contiguous() && r.device().is_cpu() && r.numel() == n,
              "residual must be a contiguous float32 CPU tensor of ", n, " values");
  return r.mutable_data_ptr<float>();
}

// Blocks per group: int2 sums the |x| of 8 whole blocks side by side (abs_sums: one sequential sum
// each, as a single sum is bound by the addition's latency); the absmax schemes take one block at a
// time.
template <int kBits>
constexpr int64_t group_blocks() {
  return Width<kBits>::kMeanScale ? 8 : 1;
}

// How the blocks split into tasks: `grain` blocks each (kGrainValues values or one block, rounded
// up to whole groups and so that a task starts at a byte boundary of the packed codes), over
// `workers` threads: at most the caller's `threads`, never more than there are tasks.
struct Plan {
  int64_t n, block, count, grain, tasks, workers;
};

template <int kBits>
Plan plan(const Blocks& b, int64_t threads) {
  int64_t per = Width<kBits>::kPer;
  int64_t align = std::lcm(per / std::gcd(b.block, per), group_blocks<kBits>());
  int64_t grain = std::max<int64_t>(1, kGrainValues / b.block);
  grain = (grain + align - 1) / align * align;
  int64_t tasks = (b.count + grain - 1) / grain;
  return {b.n, b.block, b.count, grain, tasks, std::max<int64_t>(1, std::min(threads, tasks))};
}

// Runs fn(first_block, end_block, worker) over the plan's tasks, worker in [0, workers). Blocks
// are independent (tasks touch disjoint bytes), so the split never changes a result.
template <typename F>
void run(const Plan& p, F fn) {
  if (p.workers <= 1) {
    fn(int64_t{0}, p.count, 0);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel for num_threads(static_cast<int>(p.workers)) schedule(static)
  for (int64_t t = 0; t < p.tasks; ++t) {
    fn(t * p.grain, std::min(p.count, (t + 1) * p.grain), omp_get_thread_num());
  }
#else
  // Built without OpenMP (macOS clang has none): split the tasks over std::threads, a contiguous
  // run of tasks each.
  int64_t per = (p.tasks + p.workers - 1) / p.workers;
  auto span = [&](int64_t w) {
    fn(std::min(p.count, w * per * p.grain), std::min(p.count, (w + 1) * per * p.grain), static_cast<int>(w));
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < p.workers && w * per < p.tasks; ++w) pool.emplace_back(span, w);
  span(0);
  for (auto& thread : pool) thread.join();
#endif
}

// A run of g() consecutive blocks, at most kG: block k0 starts at value first, and the group holds
// `values` values (only its last block, the tensor's last, can be short). With kG = 1 the compiler
// sees a single block.
template <int64_t kG>
struct Group {
  int64_t k0, count, first, values;
  int64_t g() const { return kG == 1 ? 1 : count; }
  int64_t len(const Plan& p, int64_t j) const { return kG == 1 ? values : std::min(p.block, values - j * p.block); }
};

// Runs fn(group, worker) over the groups of every task, in block order within a task.
template <int kBits, typename F>
void for_each_group(const Plan& p, F fn) {
  constexpr int64_t kG = group_blocks<kBits>();
  run(p, [&](int64_t begin, int64_t end, int worker) {
    for (int64_t k = begin; k < end; k += kG) {
      int64_t g = std::min(kG, end - k), first = k * p.block;
      fn(Group<kG>{k, g, first, std::min(p.n, (k + g) * p.block) - first}, worker);
    }
  });
}

// The scales of a group's blocks (values at t), and their invs.
template <int kBits>
inline void group_scales(const Plan& p, const Group<group_blocks<kBits>()>& gr, const float* t, float* scales,
                         float* invs) {
  constexpr int64_t kG = group_blocks<kBits>();
  if constexpr (kG > 1) {
    if (gr.g() == kG && gr.values == kG * p.block) {
      float sums[kG];
      abs_sums<kG>(t, p.block, p.block, sums);
      for (int64_t j = 0; j < kG; ++j) scales[j] = mean_scale(sums[j], p.block, &invs[j]);
      return;
    }
  }
  for (int64_t j = 0; j < gr.g(); ++j) scales[j] = block_scale<kBits>(t + j * p.block, gr.len(p, j), &invs[j]);
}

// ---------------------------------------------------------------------------------------------
// Kernels

template <int kBits>
void quantize_impl(const Plan& p, const float* xp, uint8_t* qp, float* sp, float* rp) {
  for_each_group<kBits>(p, [&](const Group<group_blocks<kBits>()>& gr, int) ZB_INLINE {
    const float* t = xp + gr.first;
    if (rp != nullptr) {  // t = x + residual, kept in the residual until it becomes t - value
      float* __restrict r = rp + gr.first;
      const float* __restrict x = xp + gr.first;
      for (int64_t i = 0; i < gr.values; ++i) r[i] = x[i] + r[i];
      t = r;
    }
    float invs[group_blocks<kBits>()];
    group_scales<kBits>(p, gr, t, sp + gr.k0, invs);
    for (int64_t j = 0; j < gr.g(); ++j) {
      int64_t first = gr.first + j * p.block, len = gr.len(p, j);
      encode<kBits>(t + j * p.block, qp, first, len, invs[j]);
      if (rp != nullptr) decode<kBits, Op::kSub>(qp, first, len, sp[gr.k0 + j], rp + first);
    }
  });
}

template <int kBits, Op kOp>
void dequantize_impl(const Plan& p, const uint8_t* qp, const float* sp, float* op) {
  run(p, [&](int64_t begin, int64_t end, int) {
    for (int64_t k = begin; k < end; ++k) {
      int64_t first = k * p.block;
      decode<kBits, kOp>(qp, first, std::min(p.block, p.n - first), sp[k], op + first);
    }
  });
}

// One ring hop fused in cache, per group of blocks: s = acc (+ residual) + dequantize(in);
// t = s / divisor (if divisor != 1); quantize t into out; with write_back, acc = dequantize(out)
// (the owner's final values); with a residual, residual = s - dequantize(out) * divisor (or
// s - dequantize(out)).
template <int kBits>
void reduce_quantize_impl(const Plan& p, const uint8_t* iq, const float* is, float* ap, uint8_t* oq, float* os,
                          float div, bool write_back, float* rp) {
  constexpr int64_t kG = group_blocks<kBits>();
  // A group's values stay in a buffer: a local array (the compiler then knows its alignment and that
  // nothing aliases it: a pointer chosen at run time cost ~15% in cache), or when too big, one heap
  // buffer per worker, made before the threads start.
  const int64_t size = kG * p.block;
  std::vector<float> heap(size > kMaxStackBlock ? p.workers * size : 0);
  const bool divide = div != 1.0f;
  auto hop = [&](const Group<kG>& gr, int worker, auto on_heap) ZB_INLINE {
    alignas(64) float stack[decltype(on_heap)::value ? 1 : kMaxStackBlock];  // the group's sum stays in L1
    float* __restrict tp;
    if constexpr (decltype(on_heap)::value) {
      tp = heap.data() + worker * size;
    } else {
      tp = stack;
    }
    // s = acc (+ residual) + dequantize(in): in the residual itself when there is one (it keeps s
    // until it becomes s - value * d), else in the buffer; t = s / d in the buffer.
    const float* __restrict a = ap + gr.first;
    float* sum = tp;
    if (rp != nullptr) {
      sum = rp + gr.first;
      for (int64_t i = 0; i < gr.values; ++i) sum[i] = a[i] + sum[i];
    }
    for (int64_t j = 0; j < gr.g(); ++j) {
      int64_t first = gr.first + j * p.block, len = gr.len(p, j);
      if (rp != nullptr) {
        decode<kBits, Op::kAdd>(iq, first, len, is[gr.k0 + j], sum + j * p.block);
      } else {
        decode<kBits, Op::kAddFrom>(iq, first, len, is[gr.k0 + j], tp + j * p.block, 1.0f, a + j * p.block);
      }
    }
    const float* t = sum;
    if (divide) {
      for (int64_t i = 0; i < gr.values; ++i) tp[i] = sum[i] / div;
      t = tp;
    }
    float invs[kG];
    group_scales<kBits>(p, gr, t, os + gr.k0, invs);
    for (int64_t j = 0; j < gr.g(); ++j) {
      int64_t first = gr.first + j * p.block, len = gr.len(p, j);
      float s = os[gr.k0 + j];
      encode<kBits>(t + j * p.block, oq, first, len, invs[j]);
      if (rp != nullptr) {
        if (divide) {
          decode<kBits, Op::kSubMul>(oq, first, len, s, rp + first, div);
        } else {
          decode<kBits, Op::kSub>(oq, first, len, s, rp + first);
        }
      }
      if (write_back) decode<kBits, Op::kSet>(oq, first, len, s, ap + first);
    }
  };
  if (heap.empty()) {
    for_each_group<kBits>(p, [&](const Group<kG>& gr, int worker) ZB_INLINE { hop(gr, worker, std::false_type{}); });
  } else {
    for_each_group<kBits>(p, [&](const Group<kG>& gr, int worker) ZB_INLINE { hop(gr, worker, std::true_type{}); });
  }
}

// Calls fn(std::integral_constant<int, bits>{}) for bits in {8, 4, 2}.
template <typename F>
void by_width(int bits, F fn) {
  switch (bits) {
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    default: fn(std::integral_constant<int, 2>{}); break;
  }
}

void quantize(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales, int64_t block, int64_t bits,
              const c10::optional<at::Tensor>& residual, int64_t threads) {
  Blocks b = check_args(x, codes, scales, block, bits, threads);
  float* rp = residual_ptr(residual, b.n);
  if (b.n == 0) return;
  const float* xp = x.const_data_ptr<float>();
  uint8_t* qp = codes.mutable_data_ptr<uint8_t>();
  float* sp = scales.mutable_data_ptr<float>();
  by_width(b.bits, [&](auto w) {
    constexpr int kBits = decltype(w)::value;
    quantize_impl<kBits>(plan<kBits>(b, threads), xp, qp, sp, rp);
  });
}

void dequantize_into(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out, int64_t block,
                     int64_t bits, int64_t threads, bool add) {
  Blocks b = check_args(out, codes, scales, block, bits, threads);
  if (b.n == 0) return;
  const uint8_t* qp = codes.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  by_width(b.bits, [&](auto w) {
    constexpr int kBits = decltype(w)::value;
    Plan p = plan<kBits>(b, threads);
    if (add) {
      dequantize_impl<kBits, Op::kAdd>(p, qp, sp, op);
    } else {
      dequantize_impl<kBits, Op::kSet>(p, qp, sp, op);
    }
  });
}

void dequantize(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out, int64_t block, int64_t bits,
                int64_t threads) {
  dequantize_into(codes, scales, out, block, bits, threads, false);
}

void dequantize_add(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& acc, int64_t block,
                    int64_t bits, int64_t threads) {
  dequantize_into(codes, scales, acc, block, bits, threads, true);
}

void reduce_quantize(const at::Tensor& in_codes, const at::Tensor& in_scales, at::Tensor& acc,
                     at::Tensor& out_codes, at::Tensor& out_scales, int64_t block, int64_t bits, double divisor,
                     bool write_back, const c10::optional<at::Tensor>& residual, int64_t threads) {
  Blocks b = check_args(acc, in_codes, in_scales, block, bits, threads);
  check_args(acc, out_codes, out_scales, block, bits, threads);
  float* rp = residual_ptr(residual, b.n);
  if (b.n == 0) return;
  const uint8_t* iq = in_codes.const_data_ptr<uint8_t>();
  const float* is = in_scales.const_data_ptr<float>();
  float* ap = acc.mutable_data_ptr<float>();
  uint8_t* oq = out_codes.mutable_data_ptr<uint8_t>();
  float* os = out_scales.mutable_data_ptr<float>();
  const float div = static_cast<float>(divisor);
  by_width(b.bits, [&](auto w) {
    constexpr int kBits = decltype(w)::value;
    reduce_quantize_impl<kBits>(plan<kBits>(b, threads), iq, is, ap, oq, os, div, write_back, rp);
  });
}

// ---------------------------------------------------------------------------------------------
// Sparse top-k (diloco.compression = sparse; the twin zb/collectives/sparse_twins.py defines it):
// per chunk of C values (the last may be shorter: L values), the K' = min(K, L) entries of largest
// |acc| (acc = beta * e + x, two roundings; acc = x without a residual), ties to the lower index,
// sent in ascending index order (an Elias-Fano code, below) with 2-bit codes under one float32 scale:
//   scale = (|acc_p0| + |acc_p1| + ..., ascending index, one addition at a time) / K'
//   code  = 2 * (acc < 0) + (|acc| >= scale * 9/8); value = +-scale * 7/8 (code 0, 2) or 11/8 (1, 3)
//   e     = acc - value at the picked entries, acc elsewhere.
// A chunk holding a NaN or an Inf sends scale NaN, indices 0 .. K'-1 and codes 0 (its residual: acc -
// NaN there, acc elsewhere); a scale below 2^-100 is sent as 0. Every NaN written is the default quiet
// NaN (0x7fc00000): with two NaN operands, which one's sign and payload the result keeps depends on the
// CPU and the operand order (torch keeps the second's, x86 code the first's), so the twin and these
// kernels canonicalize instead of agreeing on an order.
// Payload: all scales, then every chunk's index field, then every chunk's K codes (four to a byte,
// slot j in bits 2 (j % 4)); slots past K' of a short last chunk are zero bits. An index field is the
// Elias-Fano code of the chunk's ascending indices, with l the largest l where K 2^l <= C: the K low
// parts i_j mod 2^l (a little-endian stream of l-bit values), then K + C / 2^l bits with bit
// floor(i_j / 2^l) + j set for each live slot j (64 bytes at C = 4096, K = 64, where 12-bit indices
// took 96). C is a power of two and K a multiple of 8, so every chunk's fields start on a byte:
// chunks are independent, and threads split them without changing a bit.

constexpr float kSparseLow = 0.875f;    // sparse_twins.LOW, HIGH, SPLIT: exact in fp32
constexpr float kSparseHigh = 1.375f;
constexpr float kSparseSplit = 1.125f;
constexpr int64_t kSelectBlock = 32;    // values per block max (select_top: its lower bound, and what it skips)

inline float canonical_nan(float v) { return std::isnan(v) ? std::numeric_limits<float>::quiet_NaN() : v; }

struct Sparse {
  int64_t n, chunk, k, count, low_bits, low_bytes, high_bytes, index_bytes, code_bytes;
  int64_t len(int64_t c) const { return std::min(chunk, n - c * chunk); }
  int64_t live(int64_t c) const { return std::min(k, len(c)); }  // K'
  int64_t payload_bytes() const { return count * (4 + index_bytes + code_bytes); }
  // Section offsets in the payload.
  int64_t indices_at(int64_t c) const { return 4 * count + c * index_bytes; }
  int64_t codes_at(int64_t c) const { return 4 * count + count * index_bytes + c * code_bytes; }
};

// The scheme's limits are SparseScheme.problem()'s; `values` is x (compress) or acc (decode_add).
Sparse check_sparse(const at::Tensor& values, const at::Tensor& payload, int64_t chunk, int64_t k, int64_t threads) {
  TORCH_CHECK(chunk >= 16 && chunk <= 65536 && (chunk & (chunk - 1)) == 0,
              "chunk must be a power of two from 16 to 65536 (indices pack log2(chunk) bits each), got ", chunk);
  TORCH_CHECK(k >= 8 && k % 8 == 0 && k <= chunk,
              "k must be a multiple of 8 (indices and codes pack to whole bytes) from 8 to the chunk (", chunk,
              "), got ", k);
  TORCH_CHECK(threads >= 1, "threads must be at least 1, got ", threads);
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.device().is_cpu(),
              "expected a contiguous float32 CPU tensor");
  int64_t low = 0;  // SparseScheme.low_bits
  while ((k << (low + 1)) <= chunk) ++low;
  const int64_t low_bytes = k * low / 8, high_bytes = (k + (chunk >> low)) / 8;
  Sparse s{values.numel(), chunk, k, (values.numel() + chunk - 1) / chunk, low, low_bytes, high_bytes,
           low_bytes + high_bytes, k / 4};
  TORCH_CHECK(payload.scalar_type() == at::kByte && payload.is_contiguous() && payload.device().is_cpu() &&
                  payload.numel() == s.payload_bytes(),
              "payload must be a contiguous uint8 CPU tensor of SparseScheme(", chunk, ", ", k, ").payload_bytes(",
              s.n, ") = ", s.payload_bytes(), " bytes, got ", payload.numel());
  return s;
}

// Chunks split into tasks of about kGrainValues values (at least one chunk), run() as above.
Plan sparse_plan(const Sparse& s, int64_t threads) {
  int64_t grain = std::max<int64_t>(1, kGrainValues / s.chunk);
  int64_t tasks = (s.count + grain - 1) / grain;
  return {s.n, s.chunk, s.count, grain, tasks, std::max<int64_t>(1, std::min(threads, tasks))};
}

inline uint32_t mag_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b & 0x7fffffffu;
}

// A pick's rank as one integer: |acc|'s bits above, 65535 - index below. For finite values the
// order of |acc| bits is the order of magnitudes (+0 and -0 are equal), and indices are distinct,
// so this is the twin's total order (larger |acc| first, ties to the lower index) with no ties.
inline uint64_t rank_of(uint32_t mag, int64_t i) {
  return (static_cast<uint64_t>(mag) << 16) | static_cast<uint64_t>(65535 - i);
}

// Scratch of one worker for chunks of up to `chunk` values.
struct SelectScratch {
  std::vector<uint32_t> block_max, order;  // per kSelectBlock values
  std::vector<uint64_t> ranks, cut;        // the candidates, in index order and partitioned
  std::vector<int32_t> idx;                // the picks
  explicit SelectScratch(int64_t chunk)
      : block_max((chunk + kSelectBlock - 1) / kSelectBlock), order(block_max.size()), ranks(chunk), cut(chunk),
        idx(chunk) {}
};

// Max |acc| bits of each block of kSelectBlock values of acc[0..len), into bm; returns the chunk's
// max (>= kInfBits: the chunk holds a NaN or an Inf).
inline uint32_t block_maxima(const float* __restrict acc, int64_t len, uint32_t* __restrict bm) {
  uint32_t most = 0;
  int64_t b = 0, i = 0;
  for (; i + kSelectBlock <= len; i += kSelectBlock, ++b) {
    uint32_t m = 0;
    for (int64_t j = 0; j < kSelectBlock; ++j) m = std::max(m, mag_bits(acc[i + j]));  // vectorizes
    bm[b] = m;
    most = std::max(most, m);
  }
  if (i < len) {
    uint32_t m = 0;
    for (; i < len; ++i) m = std::max(m, mag_bits(acc[i]));
    bm[b] = m;
    most = std::max(most, m);
  }
  return most;
}

// The kk picks of the finite acc[0..len) (block maxima in w.block_max), in ascending index order,
// into w.idx. A lower bound first: the kk-th largest block max t0 (kk distinct values are >= t0, so
// the kk-th largest |acc| is too; with fewer blocks than kk, t0 = 0). Only values >= t0 can be
// picked: they are gathered in index order (blocks whose max is below t0 skipped) as ranks; the
// kk-th highest rank among them is the exact cut, and the ranks at or above it, still in index
// order, are the picks (no sort). Ties at t0 are all gathered, so ranks decide them by index, as
// the twin does.
inline void select_top(const float* __restrict acc, int64_t len, int64_t kk, SelectScratch& w) {
  const int64_t blocks = (len + kSelectBlock - 1) / kSelectBlock;
  uint32_t t0 = 0;
  if (blocks >= kk) {
    uint32_t* o = w.order.data();
    std::copy(w.block_max.begin(), w.block_max.begin() + blocks, o);
    std::nth_element(o, o + (kk - 1), o + blocks, std::greater<uint32_t>());
    t0 = o[kk - 1];
  }
  uint64_t* ranks = w.ranks.data();
  int64_t count = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    if (w.block_max[b] < t0) continue;
    for (int64_t i = b * kSelectBlock, e = std::min(len, i + kSelectBlock); i < e; ++i) {
      uint32_t m = mag_bits(acc[i]);
      ranks[count] = rank_of(m, i);  // written always, kept when m >= t0: no branch to mispredict
      count += m >= t0;
    }
  }
  uint64_t cut = 0;  // every candidate
  if (count > kk) {
    uint64_t* c = w.cut.data();
    std::copy(ranks, ranks + count, c);
    std::nth_element(c, c + (kk - 1), c + count, std::greater<uint64_t>());
    cut = c[kk - 1];
  }
  int32_t* idx = w.idx.data();
  int64_t picked = 0;
  for (int64_t j = 0; j < count; ++j) {
    idx[picked] = static_cast<int32_t>(65535 - static_cast<int64_t>(ranks[j] & 0xffffu));
    picked += ranks[j] >= cut;
  }
}

// values[0..count) (each < 2^bits) then zeros up to `slots`, as a little-endian bit stream of
// slots * bits / 8 bytes (slots * bits is a multiple of 8).
inline void pack_bits(const int32_t* values, int64_t count, int64_t slots, int bits, uint8_t* out) {
  uint64_t stream = 0;
  int have = 0;
  for (int64_t j = 0; j < slots; ++j) {
    uint64_t v = j < count ? static_cast<uint64_t>(values[j]) : 0;
    stream |= v << have;
    have += bits;
    while (have >= 8) {
      *out++ = static_cast<uint8_t>(stream);
      stream >>= 8;
      have -= 8;
    }
  }
}

// The Elias-Fano field of a chunk's kk ascending picks idx (the layout above); lows: kk values of scratch.
inline void pack_indices(const Sparse& s, const int32_t* idx, int64_t kk, int32_t* lows, uint8_t* out) {
  const int32_t mask = static_cast<int32_t>((int64_t{1} << s.low_bits) - 1);
  for (int64_t j = 0; j < kk; ++j) lows[j] = idx[j] & mask;
  pack_bits(lows, kk, s.k, static_cast<int>(s.low_bits), out);
  uint8_t* high = out + s.low_bytes;
  std::memset(high, 0, s.high_bytes);
  for (int64_t j = 0; j < kk; ++j) {
    const int64_t b = (idx[j] >> s.low_bits) + j;
    high[b / 8] = static_cast<uint8_t>(high[b / 8] | (1u << (b % 8)));
  }
}

// Reads a little-endian stream of `bits`-bit values, one at a time.
struct BitReader {
  const uint8_t* in;
  int bits;
  uint64_t stream = 0;
  int have = 0;
  uint32_t next() {
    while (have < bits) {
      stream |= static_cast<uint64_t>(*in++) << have;
      have += 8;
    }
    uint32_t v = static_cast<uint32_t>(stream & ((uint64_t{1} << bits) - 1));
    stream >>= bits;
    have -= bits;
    return v;
  }
};

// Bits at..at+63 of a high-part field of `bytes` bytes (past its end: zeros).
inline uint64_t high_word(const uint8_t* high, int64_t bytes, int64_t at) {
  uint64_t word = 0;
  for (int64_t b = 0, e = std::min<int64_t>(8, bytes - at); b < e; ++b) {
    word |= static_cast<uint64_t>(high[at + b]) << (8 * b);
  }
  return word;
}

// The kk indices of a chunk's Elias-Fano field into idx, in slot order; false (a forged field) when its
// high-part bits are not exactly kk ones or an index is len or more. Low parts past kk are not read.
inline bool read_indices(const Sparse& s, const uint8_t* field, int64_t kk, int64_t len, int32_t* idx) {
  BitReader low{field, static_cast<int>(s.low_bits)};
  const uint8_t* high = field + s.low_bytes;
  int64_t j = 0;
  for (int64_t at = 0; at < s.high_bytes; at += 8) {  // 64 bits at a time, the set ones lowest first
    for (uint64_t word = high_word(high, s.high_bytes, at); word != 0; word &= word - 1) {
      if (j == kk) return false;
      const int64_t i = ((at * 8 + lowest_bit(word) - j) << s.low_bits) | low.next();
      if (i >= len) return false;
      idx[j++] = static_cast<int32_t>(i);
    }
  }
  return j == kk;
}

// read_indices' verdict without reading the low parts, for a whole chunk (len = C): an index is C or
// more exactly when its high part is C / 2^l or more, and the high parts never decrease (slot j's is
// its bit's position - j), so the last set bit decides.
inline bool well_formed(const Sparse& s, const uint8_t* field, int64_t kk, int64_t len, int32_t* scratch) {
  if (len < s.chunk) return read_indices(s, field, kk, len, scratch);
  const uint8_t* high = field + s.low_bytes;
  int64_t ones = 0, top = -1;
  for (int64_t at = 0; at < s.high_bytes; at += 8) {
    const uint64_t word = high_word(high, s.high_bytes, at);
    ones += bit_count(word);
    if (word != 0) top = at * 8 + highest_bit(word);
  }
  return ones == kk && top - (kk - 1) < (s.chunk >> s.low_bits);
}

// A code's value under a scale: +-(scale * 7/8) or +-(scale * 11/8), one multiplication; the sign
// flip is exact (NaN's sign bit included, as the twin's negation).
inline float sparse_value(uint32_t code, float scale) {
  float mag = scale * ((code & 1u) ? kSparseHigh : kSparseLow);
  return (code & 2u) ? -mag : mag;
}

void sparse_compress_impl(const Sparse& s, const Plan& p, const float* xp, uint8_t* pay, float* rp, float beta) {
  std::vector<SelectScratch> scratch;  // one per worker, made before the threads start
  for (int64_t w = 0; w < p.workers; ++w) scratch.emplace_back(s.chunk);
  run(p, [&](int64_t begin, int64_t end, int worker) {
    SelectScratch& w = scratch[worker];
    std::vector<uint8_t> codes(s.code_bytes);
    std::vector<int32_t> lows(s.k);
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * s.chunk, len = s.len(c), kk = s.live(c);
      const float* acc = xp + first;
      if (rp != nullptr) {  // acc = beta * e + x, kept in the residual until the picks become acc - value
        float* __restrict r = rp + first;
        const float* __restrict x = xp + first;
        for (int64_t i = 0; i < len; ++i) {
          float q = beta * r[i];  // two roundings, as the twin: -ffp-contract=off keeps this from being an FMA
          r[i] = q + x[i];
        }
        acc = r;
      }
      float scale;
      int32_t* idx = w.idx.data();
      std::memset(codes.data(), 0, codes.size());
      const bool special = block_maxima(acc, len, w.block_max.data()) >= kInfBits;
      if (special) {
        // NaN or Inf: scale NaN, the first K' indices, codes 0 (the values arrive as NaN, never finite).
        scale = std::numeric_limits<float>::quiet_NaN();
        std::iota(idx, idx + kk, 0);
      } else {
        select_top(acc, len, kk, w);
        float total = 0.0f;
        for (int64_t j = 0; j < kk; ++j) total = total + abs_bits(acc[idx[j]]);  // ascending index, in order
        scale = total / static_cast<float>(kk);
        if (scale < kTiny) scale = 0.0f;
        const float split = scale * kSparseSplit;
        for (int64_t j = 0; j < kk; ++j) {
          float v = acc[idx[j]];
          uint32_t code = 2u * static_cast<uint32_t>(v < 0.0f) + static_cast<uint32_t>(abs_bits(v) >= split);
          codes[j / 4] = static_cast<uint8_t>(codes[j / 4] | (code << (2 * (j % 4))));
        }
      }
      std::memcpy(pay + 4 * c, &scale, sizeof(scale));
      pack_indices(s, idx, kk, lows.data(), pay + s.indices_at(c));
      std::memcpy(pay + s.codes_at(c), codes.data(), codes.size());
      if (rp != nullptr) {
        float* r = rp + first;
        for (int64_t j = 0; j < kk; ++j) {
          uint32_t code = (codes[j / 4] >> (2 * (j % 4))) & 3u;
          r[idx[j]] = r[idx[j]] - sparse_value(code, scale);
        }
        // Only a chunk with a NaN or an Inf can leave a NaN in the residual (elsewhere acc is finite and
        // the values finite or, from an overflowing sum, +-Inf).
        if (special) {
          for (int64_t i = 0; i < len; ++i) r[i] = canonical_nan(r[i]);
        }
      }
    }
  });
}

void sparse_compress(const at::Tensor& x, at::Tensor& payload, int64_t chunk, int64_t k,
                     const c10::optional<at::Tensor>& residual, double beta, int64_t threads) {
  Sparse s = check_sparse(x, payload, chunk, k, threads);
  float* rp = residual_ptr(residual, s.n);
  if (s.n == 0) return;
  // beta rounds to fp32 once, as the twin's full_like(residual, beta).
  sparse_compress_impl(s, sparse_plan(s, threads), x.const_data_ptr<float>(), payload.mutable_data_ptr<uint8_t>(),
                       rp, static_cast<float>(beta));
}

// acc += the payload's values, chunk by chunk, slot by slot (one rounding per addition; a repeated
// index, possible only in a forged payload, adds in slot order as in the twin, and a chunk is never
// split between threads). Every chunk's index field is checked (well_formed) before anything is
// added, so a forged one refuses the payload whole.
bool sparse_decode_add(const at::Tensor& payload, at::Tensor& acc, int64_t chunk, int64_t k, int64_t threads) {
  Sparse s = check_sparse(acc, payload, chunk, k, threads);
  if (s.n == 0) return true;
  const uint8_t* pay = payload.const_data_ptr<uint8_t>();
  float* ap = acc.mutable_data_ptr<float>();
  const Plan plan = sparse_plan(s, threads);
  std::atomic<bool> forged{false};
  run(plan, [&](int64_t begin, int64_t end, int) {
    std::vector<int32_t> idx(s.k);
    for (int64_t c = begin; c < end && !forged.load(std::memory_order_relaxed); ++c) {
      if (!well_formed(s, pay + s.indices_at(c), s.live(c), s.len(c), idx.data())) forged = true;
    }
  });
  if (forged) return false;
  // The entries a chunk adds to are scattered over its lines, too sparsely for the hardware to
  // prefetch: each chunk's are asked for while the chunk before it is added.
  run(plan, [&](int64_t begin, int64_t end, int) {
    std::vector<int32_t> cur(s.k), next(s.k);
    auto indices = [&](int64_t c, int32_t* into) ZB_INLINE {
      read_indices(s, pay + s.indices_at(c), s.live(c), s.len(c), into);
      const float* a = ap + c * s.chunk;
      for (int64_t j = 0, kk = s.live(c); j < kk; ++j) ZB_PREFETCH_WRITE(a + into[j]);
    };
    if (begin < end) indices(begin, cur.data());
    for (int64_t c = begin; c < end; ++c) {
      if (c + 1 < end) indices(c + 1, next.data());
      float scale;
      std::memcpy(&scale, pay + 4 * c, sizeof(scale));
      const uint8_t* codes = pay + s.codes_at(c);
      float* a = ap + c * s.chunk;
      for (int64_t j = 0, kk = s.live(c); j < kk; ++j) {
        a[cur[j]] = canonical_nan(a[cur[j]] + sparse_value((codes[j / 4] >> (2 * (j % 4))) & 3u, scale));
      }
      std::swap(cur, next);
    }
  });
  return true;
}

}  // namespace

// 1 when the kernels use OpenMP, 0 when they split blocks over std::threads.
int64_t openmp() {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

TORCH_LIBRARY(zb, m) {
  m.def("quantize(Tensor x, Tensor(a!) codes, Tensor(b!) scales, int block, int bits, Tensor(c!)? residual, "
        "int threads) -> ()");
  m.def("dequantize(Tensor codes, Tensor scales, Tensor(a!) out, int block, int bits, int threads) -> ()");
  m.def("dequantize_add(Tensor codes, Tensor scales, Tensor(a!) acc, int block, int bits, int threads) -> ()");
  m.def("reduce_quantize(Tensor in_codes, Tensor in_scales, Tensor(a!) acc, Tensor(b!) out_codes, "
        "Tensor(c!) out_scales, int block, int bits, float divisor, bool write_back, Tensor(d!)? residual, "
        "int threads) -> ()");
  m.def("sparse_compress(Tensor x, Tensor(a!) payload, int chunk, int k, Tensor(b!)? residual, float beta, "
        "int threads) -> ()");
  m.def("sparse_decode_add(Tensor payload, Tensor(a!) acc, int chunk, int k, int threads) -> bool");
  m.def("openmp() -> int", &openmp);
}

TORCH_LIBRARY_IMPL(zb, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_add", &dequantize_add);
  m.impl("reduce_quantize", &reduce_quantize);
  m.impl("sparse_compress", &sparse_compress);
  m.impl("sparse_decode_add", &sparse_decode_add);
}
