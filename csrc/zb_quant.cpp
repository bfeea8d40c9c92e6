// Blockwise int8 / int4 / int2 quantization kernels for zb's all-reduce, registered as torch.ops.zb.*.
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
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

// Per-block bodies are inlined into their loops over blocks, whose invariants then stay in registers.
#if defined(__GNUC__) || defined(__clang__)
#define ZB_INLINE __attribute__((always_inline))
#else
#define ZB_INLINE
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
  m.def("openmp() -> int", &openmp);
}

TORCH_LIBRARY_IMPL(zb, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_add", &dequantize_add);
  m.impl("reduce_quantize", &reduce_quantize);
}
