// Blockwise absmax int8 quantization kernels for zb's all-reduce, registered as torch.ops.zb.*.
//
// Scheme (the pure-PyTorch twin in zb/collectives/twins.py defines the exact meaning):
//   per block of `block` values: m = max |x|; scale = m / 127 (fp32); inv = 127 / m;
//   code = round_half_even(x * inv) + 128, a uint8 in [1, 255]; value = (code - 128) * scale.
//   A block with a NaN or Inf gets scale = NaN (every value of it dequantizes to NaN), a block
//   with m < 2^-100 gets scale = 0 (all zeros); both get code 128.
// Every step is one separately rounded IEEE operation. Build with -ffp-contract=off and without
// -ffast-math so that this file, its twin and any CPU produce the same bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace {

constexpr uint32_t kInfBits = 0x7f800000u;   // |x| bits at or above this: Inf or NaN
constexpr uint32_t kTinyBits = 0x0d800000u;  // 2^-100: below it 127/m could overflow
constexpr float kMagic = 12582912.0f;        // 1.5 * 2^23: (y + M) - M rounds half to even
constexpr int64_t kGrainValues = 1 << 15;    // values per parallel task
constexpr int64_t kMaxFusedBlock = 4096;

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

// Returns the block's scale; sets *inv to 127/m, or to 0 for a special (all-128) block.
inline float block_scale(uint32_t mbits, float* inv) {
  *inv = 0.0f;
  if (mbits >= kInfBits) return std::numeric_limits<float>::quiet_NaN();
  if (mbits < kTinyBits) return 0.0f;
  float m;
  std::memcpy(&m, &mbits, sizeof(m));
  *inv = 127.0f / m;
  return m / 127.0f;
}

// y = x * inv satisfies |y| <= 127 * (1 + 2^-24)^2 < 127.5 whenever |x| <= m, so round(y) is in
// [-127, 127] and needs no clamp. Adding 1.5 * 2^23 rounds y half to even and leaves round(y) in
// the low mantissa bits: bits(y + M) = 0x4B400000 + round(y), whose low byte + 128 is the code.
// This avoids float->int conversions and clamps, which vectorize poorly.
inline void encode(const float* __restrict x, uint8_t* __restrict q, int64_t n, float inv) {
  if (inv == 0.0f) {
    std::memset(q, 128, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    float y = x[i] * inv;
    float r = y + kMagic;  // a second rounding: an FMA here would change results (-ffp-contract=off)
    uint32_t bits;
    std::memcpy(&bits, &r, sizeof(bits));
    q[i] = static_cast<uint8_t>(bits + 128u);
  }
}

inline void decode_set(const uint8_t* __restrict q, float* __restrict out, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(static_cast<int32_t>(q[i]) - 128) * s;
}

inline void decode_add(const uint8_t* __restrict q, float* __restrict acc, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) {
    float v = static_cast<float>(static_cast<int32_t>(q[i]) - 128) * s;
    acc[i] = acc[i] + v;
  }
}

struct Blocks {
  int64_t n, block, count;
};

Blocks check_args(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t block) {
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "expected a contiguous float32 CPU tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == x.numel(),
              "codes must be a contiguous uint8 tensor with as many elements as the values");
  int64_t count = (x.numel() + block - 1) / block;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == count,
              "scales must be a contiguous float32 tensor with one element per block");
  return {x.numel(), block, count};
}

// Runs fn(first_value, length, block_index) over blocks, in parallel. Blocks are independent, so
// the split never changes a result.
template <typename F>
void for_blocks(const Blocks& b, F fn) {
  int64_t grain = std::max<int64_t>(1, kGrainValues / b.block);
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      int64_t first = k * b.block;
      fn(first, std::min(b.block, b.n - first), k);
    }
  };
#ifdef _OPENMP
  at::parallel_for(0, b.count, grain, body);
#else
  // Built without OpenMP (macOS clang has none): at::parallel_for would run on one thread here,
  // so split the blocks over std::threads, as many as torch's intra-op thread count.
  int64_t tasks = std::min<int64_t>(at::get_num_threads(), (b.count + grain - 1) / grain);
  if (tasks <= 1) {
    body(0, b.count);
    return;
  }
  int64_t per = (b.count + tasks - 1) / tasks;
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < tasks && t * per < b.count; ++t) {
    pool.emplace_back(body, t * per, std::min(b.count, (t + 1) * per));
  }
  body(0, std::min(b.count, per));
  for (auto& thread : pool) thread.join();
#endif
}

void quantize(const at::Tensor& x, at::Tensor& codes, at::Tensor& scales, int64_t block) {
  Blocks b = check_args(x, codes, scales, block);
  const float* xp = x.const_data_ptr<float>();
  uint8_t* qp = codes.mutable_data_ptr<uint8_t>();
  float* sp = scales.mutable_data_ptr<float>();
  for_blocks(b, [&](int64_t first, int64_t len, int64_t k) {
    float inv;
    sp[k] = block_scale(absmax_bits(xp + first, len), &inv);
    encode(xp + first, qp + first, len, inv);
  });
}

void dequantize(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& out, int64_t block) {
  Blocks b = check_args(out, codes, scales, block);
  const uint8_t* qp = codes.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  for_blocks(b, [&](int64_t first, int64_t len, int64_t k) { decode_set(qp + first, op + first, len, sp[k]); });
}

void dequantize_add(const at::Tensor& codes, const at::Tensor& scales, at::Tensor& acc, int64_t block) {
  Blocks b = check_args(acc, codes, scales, block);
  const uint8_t* qp = codes.const_data_ptr<uint8_t>();
  const float* sp = scales.const_data_ptr<float>();
  float* ap = acc.mutable_data_ptr<float>();
  for_blocks(b, [&](int64_t first, int64_t len, int64_t k) { decode_add(qp + first, ap + first, len, sp[k]); });
}

// One ring hop fused in cache: t = acc + dequantize(in); t = t / divisor (if divisor != 1);
// quantize t into out; with write_back, acc = dequantize(out) (the owner's final values).
void reduce_quantize(const at::Tensor& in_codes, const at::Tensor& in_scales, at::Tensor& acc,
                     at::Tensor& out_codes, at::Tensor& out_scales, int64_t block, double divisor,
                     bool write_back) {
  Blocks b = check_args(acc, in_codes, in_scales, block);
  check_args(acc, out_codes, out_scales, block);
  TORCH_CHECK(block <= kMaxFusedBlock, "the fused kernel takes blocks of at most ", kMaxFusedBlock, " values");
  const uint8_t* iq = in_codes.const_data_ptr<uint8_t>();
  const float* is = in_scales.const_data_ptr<float>();
  float* ap = acc.mutable_data_ptr<float>();
  uint8_t* oq = out_codes.mutable_data_ptr<uint8_t>();
  float* os = out_scales.mutable_data_ptr<float>();
  const float div = static_cast<float>(divisor);
  for_blocks(b, [&](int64_t first, int64_t len, int64_t k) {
    alignas(64) float tp[kMaxFusedBlock];  // the block's sum stays in L1
    std::memcpy(tp, ap + first, len * sizeof(float));
    decode_add(iq + first, tp, len, is[k]);
    if (div != 1.0f) {
      for (int64_t i = 0; i < len; ++i) tp[i] = tp[i] / div;
    }
    float inv;
    os[k] = block_scale(absmax_bits(tp, len), &inv);
    encode(tp, oq + first, len, inv);
    if (write_back) decode_set(oq + first, ap + first, len, os[k]);
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
  m.def("quantize(Tensor x, Tensor(a!) codes, Tensor(b!) scales, int block) -> ()");
  m.def("dequantize(Tensor codes, Tensor scales, Tensor(a!) out, int block) -> ()");
  m.def("dequantize_add(Tensor codes, Tensor scales, Tensor(a!) acc, int block) -> ()");
  m.def("reduce_quantize(Tensor in_codes, Tensor in_scales, Tensor(a!) acc, Tensor(b!) out_codes, "
        "Tensor(c!) out_scales, int block, float divisor, bool write_back) -> ()");
  m.def("openmp() -> int", &openmp);
}

TORCH_LIBRARY_IMPL(zb, CPU, m) {
  m.impl("quantize", &quantize);
  m.impl("dequantize", &dequantize);
  m.impl("dequantize_add", &dequantize_add);
  m.impl("reduce_quantize", &reduce_quantize);
}
