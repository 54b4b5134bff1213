// Only the headers these kernels use. <torch/extension.h> brings the whole C++ frontend (nn, optim, data)
// and doubled the compile that a first load waits for (docs/DECISIONS.md, "Building the fused kernels").
// ATen's Tensor (its methods included), then one header per ATen function called as at::NAME or torch::NAME
// (ATen/ops/NAME.h: a new function needs its line here), then torch's pybind11 casters for tensors.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <cstring>
#include <vector>

#include "decode_attention.h"
#include "lowbit_dot.h"

namespace torch {  // as <torch/extension.h> has it (torch/types.h)
using namespace at;  // torch::Tensor, torch::empty
}

// transformers' RMSNorm on rows of x [..., H], in its rounding: the mean of squares and the scaling in
// float32, the normalized row rounded to x's dtype, then multiplied by the weight (in float32, rounded).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight must be [H]");
  auto in = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(in);
  const int64_t rows = H ? in.numel() / H : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = in.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const float epsilon = static_cast<float>(eps);
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* a = xp + r * H;
        scalar_t* o = op + r * H;
        // The squares rounded to float32 as torch's pow rounds them, summed in double: torch's mean sums
        // them in a cascade of float32 partial sums, which a plain float32 running sum misses by tens of
        // units at a width of thousands (the agreement check then kept the module's own eight ops).
        double sum = 0.0;
        for (int64_t i = 0; i < H; ++i) {
          const float v = static_cast<float>(a[i]);
          sum += static_cast<double>(v * v);
        }
        const float variance = static_cast<float>(sum / static_cast<double>(H));
        const float inv = 1.f / std::sqrt(variance + epsilon);
        for (int64_t i = 0; i < H; ++i) {
          const scalar_t normed = static_cast<scalar_t>(static_cast<float>(a[i]) * inv);
          o[i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}

// Rotary position embedding as transformers' apply_rotary_pos_emb computes it, x * cos + rotate_half(x) *
// sin, with each product and the sum rounded to x's dtype as torch's ops round them: x [B, heads, S, D]
// (any strides but the last), cos and sin [B or 1, S, D], broadcast over the heads.
static torch::Tensor rotate(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const int64_t B = x.size(0), heads = x.size(1), S = x.size(2), D = x.size(3), half = D / 2;
  const int64_t cos_batch = cos.size(0) == 1 ? 0 : S * D;
  auto out = torch::empty({B, heads, S, D}, x.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t sb = x.stride(0), sh = x.stride(1), ss = x.stride(2);
    at::parallel_for(0, B * heads * S, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const int64_t b = r / (heads * S), h = (r / S) % heads, t = r % S;
        const scalar_t* a = xp + b * sb + h * sh + t * ss;
        const scalar_t* c = cp + b * cos_batch + t * D;
        const scalar_t* s = sp + b * cos_batch + t * D;
        scalar_t* o = op + r * D;
        for (int64_t i = 0; i < D; ++i) {
          const float rotated = i < half ? -static_cast<float>(a[i + half]) : static_cast<float>(a[i - half]);
          const scalar_t first = static_cast<scalar_t>(static_cast<float>(a[i]) * static_cast<float>(c[i]));
          const scalar_t second = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(rotated)) * static_cast<float>(s[i]));
          o[i] = static_cast<scalar_t>(static_cast<float>(first) + static_cast<float>(second));
        }
      }
    });
  });
  return out;
}

std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.dim() == 3, "rotary: q, k [B, heads, S, D]; cos, sin [B, S, D]");
  TORCH_CHECK(q.scalar_type() == cos.scalar_type() && k.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type(),
              "rotary: q, k, cos and sin must share a dtype");
  const int64_t D = q.size(3);
  TORCH_CHECK(D % 2 == 0 && k.size(3) == D && cos.size(2) == D && sin.sizes() == cos.sizes(), "rotary: head dims differ");
  TORCH_CHECK(q.size(2) == cos.size(1) && k.size(2) == cos.size(1), "rotary: positions differ");
  TORCH_CHECK((cos.size(0) == 1 || cos.size(0) == q.size(0)) && k.size(0) == q.size(0), "rotary: batch sizes differ");
  auto c = cos.contiguous(), s = sin.contiguous();
  return {rotate(q, c, s), rotate(k, c, s)};
}

// The SiLU gate of transformers' experts, act(gate) * up over h [..., 2I] = [gate | up], with torch's own
// silu and mul (called here without the Python between them): the module's numbers, bit for bit.
static void silu_gate_into(const torch::Tensor& h, torch::Tensor& out) {
  const int64_t I = h.size(-1) / 2;
  at::mul_out(out, at::silu(h.narrow(-1, 0, I)), h.narrow(-1, I, I));
}

torch::Tensor silu_gate(torch::Tensor h) {
  TORCH_CHECK(h.size(-1) % 2 == 0, "silu_gate: the last dim must be even");
  auto sizes = h.sizes().vec();
  sizes.back() /= 2;
  auto out = torch::empty(sizes, h.options());
  silu_gate_into(h, out);
  return out;
}

// A top-k router as transformers' softmax routers compute it, with the same torch ops called from here:
// logits = x W^T, probabilities = softmax in float32, their top k (divided by their sum if `normalize`,
// cast back to the logits' dtype if `cast`) -> (logits, weights, indices).
std::vector<torch::Tensor> softmax_topk_router(torch::Tensor x, torch::Tensor weight, int64_t k, bool normalize, bool cast) {
  auto logits = at::linear(x.reshape({-1, weight.size(1)}), weight);
  auto probabilities = at::softmax(logits, -1, at::kFloat);
  auto top = at::topk(probabilities, k, -1);
  auto values = std::get<0>(top);
  if (normalize) values.div_(values.sum(-1, true));
  if (cast) values = values.to(logits.scalar_type());
  return {logits, values, std::get<1>(top)};
}

// ---- int8 activations against low-bit weights (lowbit_dot.h), as torch tensors ----------------------------

// x [M, K], float32 or bf16 -> its rows quantized for weights of `group` (0: int8 weights).
static void quantize_rows(const torch::Tensor& x, int64_t group, lowbit::Activations& a) {
  TORCH_CHECK(x.dim() == 2, "int8 activations: x must be [M, K]");
  auto in = x.contiguous();
  const int64_t rows = in.size(0), k = in.size(1);
  TORCH_CHECK(k % (group ? lowbit::kSuper : lowbit::kBlock) == 0, "int8 activations: K must be a multiple of ",
              group ? lowbit::kSuper : lowbit::kBlock);
  if (in.scalar_type() == at::kBFloat16)
    lowbit::quantize(reinterpret_cast<const uint16_t*>(in.data_ptr()), rows, k, group, a);
  else if (in.scalar_type() == at::kFloat)
    lowbit::quantize(in.data_ptr<float>(), rows, k, group, a);
  else {  // float16 and others: through float32 (exact for float16)
    auto wide = in.to(at::kFloat);
    lowbit::quantize(wide.data_ptr<float>(), rows, k, group, a);
  }
}

// Output rows split across torch's threads in units of `unit` rows, each task at least ~32 KB of weights.
template <typename F>
static torch::Tensor over_rows(const lowbit::Activations& a, int64_t n, int64_t unit, int64_t row_bytes, at::ScalarType dtype, F rows) {
  auto y = torch::empty({a.rows, n}, at::TensorOptions().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(row_bytes * unit, 1));
  at::parallel_for(0, n / unit, grain, [&](int64_t begin, int64_t end) { rows(begin * unit, end * unit, out); });
  return dtype == at::kFloat ? y : y.to(dtype);
}

// The int4 family's codes in the store's portable bytes, w [N, K/2] uint8 (int6: [N, 3K/4], lowbit::row_bytes),
// with scales and zeros [K/G, N, 2] bf16.
static torch::Tensor int4_rows(const lowbit::Activations& a, const torch::Tensor& w, const torch::Tensor& sz, int64_t bits, at::ScalarType dtype,
                               const int8_t* table = nullptr) {
  TORCH_CHECK((bits >= 2 && bits <= 4) || bits == 6, "int4 x int8: 2, 3, 4 or 6 bits");
  const int64_t n = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == lowbit::row_bytes(static_cast<int>(bits), a.k) &&
                  n % 8 == 0,
              "int4 x int8: the codes must be contiguous uint8 [N, K/2] (int6: [N, 3K/4]), N a multiple of 8");
  TORCH_CHECK(sz.dim() == 3 && sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.size(0) * a.group == a.k && sz.size(1) == n &&
                  sz.size(2) == 2,
              "int4 x int8: scales and zeros must be contiguous bf16 [K/G, N, 2]");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sz.data_ptr());
  return over_rows(a, n, 8, w.size(1), dtype,
                   [&](int64_t b, int64_t e, float* y) { lowbit::int4_rows(a, wp, sp, static_cast<int>(bits), n, b, e, y, table); });
}

// int8 codes w [N, K] with per-channel scales [N] (float32 or bf16).
static torch::Tensor int8_rows(const lowbit::Activations& a, const torch::Tensor& w, const torch::Tensor& scales, at::ScalarType dtype) {
  const int64_t n = w.size(0);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() && w.size(1) == a.k, "int8 x int8: codes must be contiguous int8 [N, K]");
  TORCH_CHECK(scales.numel() == n && scales.is_contiguous() && (scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16),
              "int8 x int8: scales must be contiguous float32 or bf16 [N]");
  const int8_t* wp = w.data_ptr<int8_t>();
  const void* sp = scales.data_ptr();
  const bool bf16 = scales.scalar_type() == at::kBFloat16;
  return over_rows(a, n, 1, a.k, dtype, [&](int64_t b, int64_t e, float* y) { lowbit::int8_rows(a, wp, sp, bf16, n, b, e, y); });
}

// x quantized for a matrix of `bits` (8, or the int4 family's 4/3/2 with `group`), and that matrix against it.
static void quantize_for(const torch::Tensor& x, int64_t bits, int64_t group, lowbit::Activations& a) {
  quantize_rows(x, bits == 8 ? 0 : group, a);
}

// `table`: a 4-bit table format's 16 int8 values (its matrices are the int4 family's bytes, groups of 32), or null.
static torch::Tensor against(const lowbit::Activations& a, const torch::Tensor& w, const torch::Tensor& params, int64_t bits,
                             at::ScalarType dtype, const int8_t* table = nullptr) {
  return bits == 8 ? int8_rows(a, w, params, dtype) : int4_rows(a, w, params, bits, dtype, table);
}

static torch::Tensor integer_matmul(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& params, int64_t bits, int64_t group,
                                    const int8_t* table = nullptr) {
  thread_local lowbit::Activations a;
  quantize_for(x, bits, group, a);
  return against(a, w, params, bits, x.scalar_type(), table);
}

// The values of a table format as the kernels take them (quant.TABLES), checked; null for none (or an
// empty tensor, which stands for none in lists).
static const int8_t* table_values(const c10::optional<torch::Tensor>& table) {
  if (!table.has_value() || table->numel() == 0) return nullptr;
  TORCH_CHECK(table->scalar_type() == at::kChar && table->numel() == 16 && table->is_contiguous() && table->device().is_cpu(),
              "a table format's values must be 16 contiguous int8");
  return table->data_ptr<int8_t>();
}

// x [M, K] @ W.T for an int4 (portable nibbles) or int8 matrix, in int8 activations -> [M, N] in x's dtype.
// int3/int2 come as their int4 bytes (quant.expand_int4_bytes) with their `bits`; int6 as stored.
torch::Tensor int4_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales_zeros, int64_t group, int64_t bits) {
  TORCH_CHECK(group > 0 && group % lowbit::kBlock == 0, "int4_matmul: the group size must be a multiple of 32");
  TORCH_CHECK((bits >= 2 && bits <= 4) || bits == 6, "int4_matmul: 2, 3, 4 or 6 bits");
  return integer_matmul(x, w, scales_zeros, bits, group);
}

torch::Tensor int8_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales) { return integer_matmul(x, w, scales, 8, 0); }

// As int4_matmul for a 4-bit table format (quant.py: W = T[c] s + z per group of 32), `table` its 16 int8 values.
torch::Tensor table_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor scales_zeros, torch::Tensor table) {
  return integer_matmul(x, w, scales_zeros, 4, lowbit::kBlock, table_values(table));
}

#if defined(__x86_64__) && defined(__GNUC__)
// As the loop in repair_nibbles, 16 bytes of a run at a time: one shuffle puts their even bytes before
// their odd ones, then the low nibbles of both make 8 output bytes and the high nibbles 8 more.
__attribute__((target("avx2"))) static void repair_runs_simd(const uint8_t* src, uint8_t* dst, int64_t n, int64_t stride, int64_t offset,
                                                              int64_t units, int64_t unit_bytes) {
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i low = _mm_set1_epi8(0x0F);
  const int64_t m = unit_bytes / 2;
  for (int64_t b = 0; b < n; ++b)
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* q = src + b * stride + offset + u * unit_bytes;
      uint8_t* o = dst + (b * units + u) * unit_bytes;
      for (int64_t c = 0; c < unit_bytes / 16; ++c) {
        const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * c)), split);
        const __m128i odd = _mm_srli_si128(v, 8);  // the odd bytes, moved down to the evens' place
        // per 16-bit lane the nibbles stay inside their bytes: the masks drop what crosses over
        const __m128i lows = _mm_or_si128(_mm_and_si128(v, low), _mm_slli_epi16(_mm_and_si128(odd, low), 4));
        const __m128i highs = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_andnot_si128(low, odd));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(o + 8 * c), lows);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(o + m + 8 * c), highs);
      }
    }
}
#endif

// A GGUF's 4-bit codes re-paired into the store's portable nibbles (conversion/gguf_blocks.py, `_repaired`,
// which the converter runs in numpy where this module is not built): blocks [n, B] uint8, in each `units`
// runs of `unit_bytes` = 2m bytes from `offset`, the first 2m weights in the low nibbles and the next 2m in
// the high ones -> [n, units * unit_bytes], byte j < m of a run (q[2j] & 15) | q[2j+1] << 4 and byte m + j
// (q[2j] >> 4) | (q[2j+1] & 0xF0): weights in pairs, low nibble first. numpy's table lookup ran at 0.6 GB/s,
// a fifth of a Q4_0 import.
torch::Tensor repair_nibbles(torch::Tensor blocks, int64_t offset, int64_t units, int64_t unit_bytes) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "repair_nibbles: contiguous uint8 [n, B]");
  TORCH_CHECK(unit_bytes > 0 && unit_bytes % 2 == 0 && units > 0 && offset >= 0 && offset + units * unit_bytes <= blocks.size(1),
              "repair_nibbles: the runs must lie inside a block");
  const int64_t n = blocks.size(0), stride = blocks.size(1), m = unit_bytes / 2;
  auto out = torch::empty({n, units * unit_bytes}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
#if defined(__x86_64__) && defined(__GNUC__)
  if (lowbit::has_avx2() && unit_bytes % 16 == 0) {
    repair_runs_simd(src, dst, n, stride, offset, units, unit_bytes);
    return out;
  }
#endif
  for (int64_t b = 0; b < n; ++b)
    for (int64_t u = 0; u < units; ++u) {
      const uint8_t* q = src + b * stride + offset + u * unit_bytes;
      uint8_t* o = dst + (b * units + u) * unit_bytes;
      for (int64_t j = 0; j < m; ++j) {
        o[j] = static_cast<uint8_t>((q[2 * j] & 0x0F) | (q[2 * j + 1] << 4));
        o[m + j] = static_cast<uint8_t>((q[2 * j] >> 4) | (q[2 * j + 1] & 0xF0));
      }
    }
  return out;
}

// Rows of a GGUF's Q6_K blocks straight to int8 by rows, what the converter stores them as where a
// matrix goes int8 (an LM head, conversion/gguf_blocks.py's `q6_k_int8`): decoded in its float32 rounding
// (llama.cpp's dequantize_row_q6_K: w = (d * sc) * (q - 32)) into a row buffer, then quantized in
// quant.py's: s = max |w| / 127 (at least 1e-12), c = w / s rounded half to even and clamped to +-127.
// The same bits as the two in torch, in one pass instead of a dozen (a 150k-token head: 5 s of CPU).
// Within each half of a 210-byte block (128 weights), weight 32 k + l has its low 4 bits in byte l (k even)
// or 32 + l (k odd) of the half's 64 ql bytes, low nibble for k < 2, and its high two at bit 2 k of qh byte
// l; its scale is sc[2 k + l / 16] of the half's 8.
struct Q6KBlock {
  const uint8_t* ql;  // 128 bytes: the low 4 bits
  const uint8_t* qh;  // 64 bytes: the high 2
  const int8_t* sc;   // 16 scales, one per 16 weights
  float d;            // the block's fp16 scale
};

static Q6KBlock q6_k_block(const uint8_t* x) {
  uint16_t d_bits;
  std::memcpy(&d_bits, x + 208, 2);
  return {x, x + 128, reinterpret_cast<const int8_t*>(x + 192), static_cast<float>(c10::Half(d_bits, c10::Half::from_bits()))};
}

static void q6_k_decode_row(const uint8_t* row, int64_t blocks, float* w) {
  for (int64_t b = 0; b < blocks; ++b) {
    auto [ql, qh, sc, d] = q6_k_block(row + b * 210);
    float* y = w + b * 256;
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128)
      for (int k = 0; k < 4; ++k) {
        const uint8_t* low = ql + 32 * (k % 2);
        for (int l = 0; l < 32; ++l) {
          const int q = ((k < 2 ? low[l] & 0xF : low[l] >> 4) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
          y[32 * k + l] = static_cast<float>(q) * (d * static_cast<float>(sc[2 * k + l / 16]));
        }
      }
  }
}

static float int8_row(const float* w, int64_t n, int8_t* c) {
  float amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(w[j]));
  const float s = std::max(amax / 127.0f, 1e-12f);
  for (int64_t j = 0; j < n; ++j) c[j] = static_cast<int8_t>(std::clamp(std::nearbyint(w[j] / s), -127.0f, 127.0f));
  return s;
}

#if defined(__x86_64__) && defined(__GNUC__)
// As q6_k_decode_row, 32 weights (one l run of a k) at a time: the codes as bytes, then 8 at a time to float.
__attribute__((target("avx2"))) static void q6_k_decode_row_simd(const uint8_t* row, int64_t blocks, float* w) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < blocks; ++b) {
    auto [ql, qh, sc, d] = q6_k_block(row + b * 210);
    float* y = w + b * 256;
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, sc += 8, y += 128) {
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      for (int k = 0; k < 4; ++k) {
        const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * (k % 2)));
        const __m256i lo4 = k < 2 ? _mm256_and_si256(low, nibble) : _mm256_and_si256(_mm256_srli_epi16(low, 4), nibble);
        const __m256i hi2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high, 2 * k), two), 4);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo4, hi2), bias);  // -32..31: signed bytes
        alignas(32) int8_t codes[32];
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes), q);
        for (int g = 0; g < 4; ++g) {  // 8 weights at a time, all of one scale (16 weights each)
          const __m256 scale = _mm256_set1_ps(d * static_cast<float>(sc[2 * k + g / 2]));
          const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * g));
          const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight));
          _mm256_storeu_ps(y + 32 * k + 8 * g, _mm256_mul_ps(v, scale));
        }
      }
    }
  }
}

// As int8_row, 8 weights at a time: IEEE division and rounding to nearest even, the same results.
__attribute__((target("avx2"))) static float int8_row_simd(const float* w, int64_t n, int8_t* c) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(w + j)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = 0.0f;
  for (float v : lanes) amax = std::max(amax, v);
  for (; j < n; ++j) amax = std::max(amax, std::fabs(w[j]));
  const float s = std::max(amax / 127.0f, 1e-12f);
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(w + j), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    alignas(32) int32_t ints[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints), _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi)));
    for (int k = 0; k < 8; ++k) c[j + k] = static_cast<int8_t>(ints[k]);
  }
  for (; j < n; ++j) c[j] = static_cast<int8_t>(std::clamp(std::nearbyint(w[j] / s), -127.0f, 127.0f));
  return s;
}

// A group's 32 int4 codes (int4_groups), 8 at a time: IEEE subtraction, division and rounding to nearest even.
__attribute__((target("avx2"))) static void int4_codes_simd(const float* x, float z, float s, uint8_t* codes) {
  const __m256 vz = _mm256_set1_ps(z), vs = _mm256_set1_ps(s), eight = _mm256_set1_ps(8.0f);
  const __m256 lo = _mm256_setzero_ps(), hi = _mm256_set1_ps(15.0f);
  for (int j = 0; j < 32; j += 8) {
    const __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vz), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    alignas(32) int32_t ints[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints), _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, eight), lo), hi)));
    for (int k = 0; k < 8; ++k) codes[j + k] = static_cast<uint8_t>(ints[k]);
  }
}
#endif

// The rows of `blocks` after checking they are rows of cols / 256 Q6_K blocks (naming the pass `what`).
static int64_t q6_k_checked_rows(const torch::Tensor& blocks, int64_t cols, const char* what) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(), what, ": contiguous uint8 [rows, B]");
  TORCH_CHECK(cols > 0 && cols % 256 == 0 && blocks.size(1) == cols / 256 * 210, what, ": rows of cols / 256 blocks of 210 bytes");
  return blocks.size(0);
}

// Each row of Q6_K blocks (q6_k_checked_rows) decoded into a float32 row buffer and handed to
// quantize_row(r, w, simd), on at::parallel_for's threads; `simd`: the CPU's AVX2 loops are taken.
template <typename QuantizeRow>
static void q6_k_rows(const torch::Tensor& blocks, int64_t cols, QuantizeRow quantize_row) {
  constexpr int64_t kWeights = 256;
  const int64_t per_row = blocks.size(1);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  bool simd = false;
#if defined(__x86_64__) && defined(__GNUC__)
  simd = lowbit::isa() >= lowbit::Isa::avx2;
#endif
  at::parallel_for(0, blocks.size(0), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(cols);
    for (int64_t r = begin; r < end; ++r) {
#if defined(__x86_64__) && defined(__GNUC__)
      if (simd)
        q6_k_decode_row_simd(src + r * per_row, cols / kWeights, w.data());
      else
#endif
        q6_k_decode_row(src + r * per_row, cols / kWeights, w.data());
      quantize_row(r, w.data(), simd);
    }
  });
}

std::vector<torch::Tensor> q6_k_int8(torch::Tensor blocks, int64_t cols) {
  const int64_t rows = q6_k_checked_rows(blocks, cols, "q6_k_int8");
  auto codes = torch::empty({rows, cols}, blocks.options().dtype(at::kChar));
  auto scales = torch::empty({rows}, blocks.options().dtype(at::kFloat));
  int8_t* out = codes.data_ptr<int8_t>();
  float* row_scales = scales.data_ptr<float>();
  q6_k_rows(blocks, cols, [&](int64_t r, const float* w, bool simd) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd) {
      row_scales[r] = int8_row_simd(w, cols, out + r * cols);
      return;
    }
#endif
    row_scales[r] = int8_row(w, cols, out + r * cols);
  });
  return {codes, scales};
}

// Rows of Q6_K blocks to the int4 group-32 record tensors, what the converter stores them as in an int4
// layer (Q4_K_M's Q6_K down projections; conversion/gguf_blocks.py's `q6_k_int4`): decoded as q6_k_int8
// decodes them, then quantized in quant.py's rounding, group by group: s = bf16(max(hi - lo) / 15, 1e-8),
// z = bf16(lo + 8 s), c = clamp(round_half_even((w - z) / s) + 8, 0, 15), bytes of two codes (the first
// in the low nibble). The same bits as torch's decode and quantize.
static void int4_groups(const float* w, int64_t n, uint8_t* nibbles, c10::BFloat16* s_out, c10::BFloat16* z_out, bool simd) {
  for (int64_t g = 0; g < n / 32; ++g) {
    const float* x = w + 32 * g;
    float lo = x[0], hi = x[0];
    for (int j = 1; j < 32; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
    const c10::BFloat16 s(std::max((hi - lo) / 15.0f, 1e-8f));
    const float sf = static_cast<float>(s);
    const c10::BFloat16 z(lo + 8.0f * sf);
    const float zf = static_cast<float>(z);
    uint8_t codes[32];
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd) {
      int4_codes_simd(x, zf, sf, codes);
    } else
#endif
      for (int j = 0; j < 32; ++j) codes[j] = static_cast<uint8_t>(std::clamp(std::nearbyint((x[j] - zf) / sf) + 8.0f, 0.0f, 15.0f));
    for (int j = 0; j < 16; ++j) nibbles[16 * g + j] = static_cast<uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
    s_out[g] = s;
    z_out[g] = z;
  }
}

std::vector<torch::Tensor> q6_k_int4(torch::Tensor blocks, int64_t cols) {
  const int64_t rows = q6_k_checked_rows(blocks, cols, "q6_k_int4");
  auto nibbles = torch::empty({rows, cols / 2}, blocks.options());
  auto scales = torch::empty({rows, cols / 32}, blocks.options().dtype(at::kBFloat16));
  auto zeros = torch::empty({rows, cols / 32}, blocks.options().dtype(at::kBFloat16));
  uint8_t* out = nibbles.data_ptr<uint8_t>();
  c10::BFloat16* s = scales.data_ptr<c10::BFloat16>();
  c10::BFloat16* z = zeros.data_ptr<c10::BFloat16>();
  q6_k_rows(blocks, cols, [&](int64_t r, const float* w, bool simd) {
    int4_groups(w, cols, out + r * cols / 2, s + r * cols / 32, z + r * cols / 32, simd);
  });
  return {nibbles, scales, zeros};
}

static const char* const kIsaNames[] = {"portable", "avx2", "avx512-vnni"};

// The loops' variant this CPU runs ("portable", "avx2", "avx512-vnni"); with a name, the most capable one
// allowed from now on (the tests run each variant the CPU has). Returns the variant run before the call.
std::string lowbit_isa(const std::string& cap) {
  const std::string previous = kIsaNames[static_cast<int>(lowbit::isa())];
  if (!cap.empty()) {
    int i = 0;
    while (i < 3 && cap != kIsaNames[i]) ++i;
    TORCH_CHECK(i < 3, "lowbit_isa: one of portable, avx2, avx512-vnni, not ", cap);
    lowbit::isa_cap() = static_cast<lowbit::Isa>(i);
  }
  return previous;
}

// An expert's matmul as kernels.py runs it on the CPU. With `integer`, the int8-activation kernels above on
// portable bytes; else the int4 kernel in bf16 (other activations cast in and the result cast back) on
// torch's layout, the int8 kernel in the activations' dtype.
static torch::Tensor quantized(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& params, int64_t bits, int64_t group,
                               bool integer, const int8_t* table = nullptr) {
  if (integer) return integer_matmul(x, q, params, bits, group, table);
  TORCH_CHECK(table == nullptr, "a table format runs with int8 activations only");
  if (bits == 4) {
    if (x.scalar_type() == at::kBFloat16) return at::_weight_int4pack_mm_for_cpu(x, q, group, params);
    return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), q, group, params).to(x.scalar_type());
  }
  return at::_weight_int8pack_mm(x, q, params.scalar_type() == x.scalar_type() ? params : params.to(x.scalar_type()));
}

// One token through n quantized experts with the SiLU gate: x [1, H]; per expert its first matrix (gate
// and up stacked, [2I, H]) and second ([H, I]) in torch's CPU kernels' layouts (bits 4: the int4 kernel
// with `group`; 8: the int8 kernel) -> [n, H], row j expert j's output. The same kernels the engine calls
// one op at a time, without the dispatch between them.
// With `table` (int8 activations): the matrices are a 4-bit table format's (quant.py), these its 16 values.
// With `weights` [n, 1]: instead the weighted sum over the experts [1, H], as the engine computes it (its
// rows multiplied in place, then summed), one call for a whole one-token experts call.
torch::Tensor experts_decode(torch::Tensor x, std::vector<torch::Tensor> first, std::vector<torch::Tensor> first_params,
                             std::vector<torch::Tensor> second, std::vector<torch::Tensor> second_params, int64_t bits, int64_t group,
                             bool integer, c10::optional<torch::Tensor> weights, c10::optional<torch::Tensor> table) {
  const int64_t n = static_cast<int64_t>(first.size());
  TORCH_CHECK(n > 0 && first_params.size() == first.size() && second.size() == first.size() && second_params.size() == first.size(),
              "experts_decode: one first and one second matrix per expert");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "experts_decode: x must be one contiguous row [1, H]");
  TORCH_CHECK(bits == 4 || bits == 8 || (bits == 6 && integer), "experts_decode: 4 or 8 bits (6 with int8 activations)");
  const int8_t* values = table_values(table);  // a 4-bit table format (int8 activations only), or null
  TORCH_CHECK(values == nullptr || (integer && bits == 4 && group == lowbit::kBlock), "experts_decode: a table format takes int8 activations");
  thread_local lowbit::Activations shared;  // with `integer`: x quantized once for every expert's first matrix
  lowbit::Activations& xq = shared;           // (this thread's: the lambda below may run on others)
  if (integer) quantize_for(x, bits, group, xq);
  std::vector<torch::Tensor> ys(n);
  auto expert = [&](int64_t j) {
    auto h = integer ? against(xq, first[j], first_params[j], bits, x.scalar_type(), values)
                     : quantized(x, first[j], first_params[j], bits, group, false);
    auto a = torch::empty({1, h.size(1) / 2}, h.options());
    silu_gate_into(h, a);
    ys[j] = quantized(a, second[j], second_params[j], bits, group, integer, values);
  };
  // With int8 activations and at least two experts per thread, each thread takes whole experts: one fork
  // and join per call instead of two per expert (inside, the matmuls and torch's ops run on that thread).
  // Every row is computed alone, so the numbers are the same either way.
  if (integer && n >= 2 * at::get_num_threads())
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) expert(j);
    });
  else
    for (int64_t j = 0; j < n; ++j) expert(j);
  auto out = torch::empty({n, ys[0].size(1)}, ys[0].options());
  for (int64_t j = 0; j < n; ++j) std::memcpy(static_cast<char*>(out.data_ptr()) + j * ys[j].nbytes(), ys[j].data_ptr(), ys[j].nbytes());
  if (weights.has_value()) return out.mul_(*weights).view({1, n, -1}).sum(1);
  return out;
}

// A resident linear without bias as kernels.py runs it on the CPU, x [M, K] -> [M, N]: bits 0 a float
// weight (at::linear); with `integer` the int8-activation kernels (portable int4 bytes, or int8); else 8
// torch's int8 kernel (in float32 for bf16 activations whose width is not a multiple of 16, where its bf16
// path is wrong), 4 the int4 kernel (in bf16, cast back).
static torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& params, int64_t bits, int64_t group, bool integer,
                             const int8_t* table = nullptr) {
  if (bits == 0) return at::linear(x, w);
  if (integer) return integer_matmul(x, w, params, bits, group, table);
  TORCH_CHECK(table == nullptr, "a table format runs with int8 activations only");
  if (bits == 8) {
    if (x.scalar_type() == at::kBFloat16 && x.size(1) % 16)
      return at::_weight_int8pack_mm(x.to(at::kFloat), w, params.to(at::kFloat)).to(x.scalar_type());
    return at::_weight_int8pack_mm(x, w, params.scalar_type() == x.scalar_type() ? params : params.to(x.scalar_type()));
  }
  TORCH_CHECK(bits == 4, "project: 0, 4 or 8 bits");
  if (x.scalar_type() == at::kBFloat16) return at::_weight_int4pack_mm_for_cpu(x, w, group, params);
  return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w, group, params).to(x.scalar_type());
}

// One token's attention inputs as transformers' Llama-family attention computes them, x [1, H] ->
// q [1, heads, 1, D], k and v [1, kv heads, 1, D]: the three projections (weights, params, bits, groups,
// int8 activations, table formats' values or empty: q, k, v), the optional RMSNorms of q and k (over each
// head, or over the whole projection before it is split into heads), then the rotary embedding of q and k.
std::vector<torch::Tensor> attention_decode_qkv(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> params,
                                                std::vector<int64_t> bits, std::vector<int64_t> groups, std::vector<bool> integer,
                                                std::vector<torch::Tensor> tables, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                                                double q_eps, double k_eps, bool norm_per_head, int64_t head_dim,
                                                torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(weights.size() == 3 && params.size() == 3 && bits.size() == 3 && groups.size() == 3 && integer.size() == 3 && tables.size() == 3,
              "attention_decode_qkv: q, k, v");
  const int8_t* values[3] = {table_values(tables[0]), table_values(tables[1]), table_values(tables[2])};
  const auto same_table = [&](int i) {
    return (values[i] == nullptr) == (values[0] == nullptr) && (values[0] == nullptr || std::memcmp(values[i], values[0], 16) == 0);
  };
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "attention_decode_qkv: x must be one contiguous row [1, H]");
  torch::Tensor states[3];
  // With int8 activations and one format for all three, x is quantized once for them (as each would).
  const bool shared = integer[0] && integer[1] && integer[2] && bits[0] == bits[1] && bits[1] == bits[2] && groups[0] == groups[1] &&
                      groups[1] == groups[2] && (bits[0] == 4 || bits[0] == 6 || bits[0] == 8) && same_table(1) && same_table(2);
  thread_local lowbit::Activations xq;
  if (shared) quantize_for(x, bits[0], groups[0], xq);
  for (int i = 0; i < 3; ++i) {
    auto y = shared ? against(xq, weights[i], params[i], bits[i], x.scalar_type(), values[i])
                    : project(x, weights[i], params[i], bits[i], groups[i], integer[i], values[i]);
    const c10::optional<torch::Tensor>& norm = i == 0 ? q_norm : k_norm;
    const double eps = i == 0 ? q_eps : k_eps;
    if (i < 2 && norm.has_value() && !norm_per_head) y = rms_norm(y, *norm, eps);
    y = y.view({1, 1, -1, head_dim});
    if (i < 2 && norm.has_value() && norm_per_head) y = rms_norm(y, *norm, eps);
    states[i] = y.transpose(1, 2);
  }
  auto rotated = rotary(states[0], states[1], cos, sin);
  return {rotated[0], rotated[1], states[2]};
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask, double scale);

// The rest of one token's attention: the model's attention function over the cached keys and values as
// transformers calls it for one query without a mask (`flash`: decode_attention, registered as the
// model's own; else sdpa, no causal flag, grouped heads in sdpa itself), heads joined, then the output
// projection -> [1, 1, H].
torch::Tensor attention_decode_out(torch::Tensor weight, torch::Tensor params, int64_t bits, int64_t group, bool integer, torch::Tensor table,
                                   double scale, bool grouped, bool flash, torch::Tensor q, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(flash || k.scalar_type() != at::kChar, "attention_decode_out: an 8-bit KV cache is read by the flash-decoding kernel only");
  auto o = flash ? decode_attention(q, k, v, c10::nullopt, scale) : at::scaled_dot_product_attention(q, k, v, c10::nullopt, 0.0, false, scale, grouped);
  return project(o.transpose(1, 2).reshape({1, -1}), weight, params, bits, group, integer, table_values(table)).view({1, 1, -1});
}

// One query position per row against a KV cache (decode_attention.h): q [B, H, 1, D], k and v [B, KVH, T, D]
// (float32 or bf16, or an 8-bit cache's rows [B, KVH, T, D + 4]: D int8 codes, then the float32 scale's bytes;
// their last dimension contiguous, any other strides: a growing cache's views), an optional
// mask [B or 1, 1, 1, T] (bool: true attends; or additive float) -> [B, H, 1, D] in q's dtype. The
// positions are cut into pieces of 256 counted from the last one: a batch's rows are right-aligned (a shorter
// row's padding masked at the front), so a row meets the same pieces, summed in the same order, as it does
// alone, and its answer has the same bits in a batch as alone, whatever the number of threads.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1, "decode_attention: q [B, H, 1, D], k and v [B, KVH, T, D]");
  const bool int8 = k.scalar_type() == at::kChar;
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) + (int8 ? 4 : 0) && q.size(1) % k.size(1) == 0,
              "decode_attention: shapes do not match");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16 || int8),
              "decode_attention: keys and values in float32, bf16 or int8 rows with their scales");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: the head dimension must be contiguous");
  flash_decode::Layout s{q.size(0), q.size(1), k.size(1), k.size(2), q.size(3), k.stride(0), k.stride(1), k.stride(2),
                             v.stride(0), v.stride(1), v.stride(2), 0};
  const int64_t B = s.rows, H = s.heads, KVH = s.kv_heads, T = s.positions, D = s.dim, G = H / KVH;
  auto queries = at::mul(q.to(at::kFloat), scale).contiguous();  // [B, H, 1, D]
  torch::Tensor bias;
  if (mask.has_value()) {
    auto m = *mask;
    TORCH_CHECK(m.dim() == 4 && m.size(-1) == T && m.size(1) == 1 && m.size(2) == 1 && (m.size(0) == 1 || m.size(0) == B),
                "decode_attention: mask [B or 1, 1, 1, T]");
    m = m.scalar_type() == at::kBool ? torch::zeros(m.sizes(), at::kFloat).masked_fill_(m.logical_not(), -INFINITY) : m.to(at::kFloat);
    bias = m.reshape({m.size(0), T}).contiguous();
    s.mask_batch = m.size(0) == 1 ? 0 : T;
  }
  constexpr int64_t length = 256;
  const int64_t pieces = std::max<int64_t>(1, (T + length - 1) / length);
  auto top = torch::empty({B * KVH * pieces, G}, at::kFloat);
  auto sums = torch::empty({B * KVH * pieces, G}, at::kFloat);
  auto acc = torch::empty({B * KVH * pieces, G, D}, at::kFloat);
  const float* qp = queries.data_ptr<float>();
  const float* mp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float *tp = top.data_ptr<float>(), *lp = sums.data_ptr<float>(), *ap = acc.data_ptr<float>();
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  at::parallel_for(0, B * KVH * pieces, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * length), row(D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (KVH * pieces), kv = item / pieces % KVH, i = item % pieces;
      const int64_t t1 = T - (pieces - 1 - i) * length, t0 = std::max<int64_t>(0, t1 - length);
      float *m = tp + item * G, *l = lp + item * G, *a = ap + item * G * D;
      if (t0 == t1) {
        std::fill(m, m + G, -INFINITY), std::fill(l, l + G, 0.f), std::fill(a, a + G * D, 0.f);
        continue;
      }
      const float* qg = qp + (b * H + kv * G) * D;
      if (int8)
        flash_decode::piece_int8(s, qg, k.data_ptr<int8_t>(), v.data_ptr<int8_t>(), mp, b, kv, t0, t1, m, l, a, scores.data(), row.data());
      else if (bf16)
        flash_decode::piece_bf16(s, qg, reinterpret_cast<const uint16_t*>(k.data_ptr()), reinterpret_cast<const uint16_t*>(v.data_ptr()),
                                     mp, b, kv, t0, t1, m, l, a, scores.data(), row.data());
      else
        flash_decode::piece_float(s, qg, k.data_ptr<float>(), v.data_ptr<float>(), mp, b, kv, t0, t1, m, l, a, scores.data(), row.data());
    }
  });
  auto out = torch::empty({B, H, 1, D}, at::kFloat);
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> m(pieces), l(pieces);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, kv = h / G, g = h % G;
      const int64_t first = (b * KVH + kv) * pieces;
      for (int64_t i = 0; i < pieces; ++i) m[i] = tp[(first + i) * G + g], l[i] = lp[(first + i) * G + g];
      flash_decode::merge(pieces, m.data(), l.data(), ap + first * G * D + g * D, G * D, D, op + bh * D);
    }
  });
  return out.to(q.scalar_type());
}

// The hand-written loops decode_attention may take: "avx512", "avx2" or "loops" (the compiler's alone, as a
// CPU without AVX2 runs); returns the ones this CPU took before the call. (The tests run each on one CPU.)
std::string decode_attention_simd(const std::string& cap) {
#if defined(__x86_64__) && defined(__GNUC__)
  const std::string previous = flash_decode::has_avx512() ? "avx512" : flash_decode::has_avx2() ? "avx2" : "loops";
  TORCH_CHECK(cap == "avx512" || cap == "avx2" || cap == "loops", "decode_attention_simd: avx512, avx2 or loops, not ", cap);
  flash_decode::simd_cap() = cap == "avx512" ? 2 : cap == "avx2" ? 1 : 0;
  return previous;
#else
  return "loops";
#endif
}

// ---- int4 codes from the store's portable layout to torch's CPU kernel layout ----------------------------
// The store keeps int4 codes as plain nibbles in row order (src [N, K/2]: byte j of row n holds inputs 2j and
// 2j+1). torch's CPU kernel reads another layout, different per CPU build: each of its bytes pairs input k
// of two rows. It is described here by "columns", N/2 of them (repack.py derives them from torch itself):
// column c pairs rows lo[c] (low nibble) and hi[c] (high), and its byte for input k lands at
// offset[c] + k * stride[c]. With AVX2, sixteen columns with consecutive offsets and one stride are done
// together: 32 bytes of each of their rows, combined, then a 16x16 byte transpose in each 128-bit lane turns
// "per column, 16 inputs" into "per input, 16 columns", which is what the kernel layout stores contiguously.
// Elsewhere (no AVX2, irregular columns) one column at a time.
static void repack_columns(const uint8_t* src, uint8_t* dst, int64_t half_k, const int64_t* lo, const int64_t* hi,
                           const int64_t* offset, const int64_t* stride, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* a = src + lo[c] * half_k;
    const uint8_t* b = src + hi[c] * half_k;
    uint8_t* o = dst + offset[c];
    const int64_t s = stride[c];
    for (int64_t j = 0; j < half_k; ++j) {
      o[(2 * j) * s] = static_cast<uint8_t>((a[j] & 0x0F) | (b[j] << 4));
      o[(2 * j + 1) * s] = static_cast<uint8_t>((a[j] >> 4) | (b[j] & 0xF0));
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MOESTREAM_AVX2 __attribute__((target("avx2")))

// r[t] byte u -> r[u] byte t, for t, u < 16, in each 128-bit lane.
MOESTREAM_AVX2 static inline void transpose16(__m256i r[16]) {
  __m256i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm256_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm256_unpacklo_epi16(t[4 * g + 0], t[4 * g + 2]);
    u[4 * g + 1] = _mm256_unpackhi_epi16(t[4 * g + 0], t[4 * g + 2]);
    u[4 * g + 2] = _mm256_unpacklo_epi16(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm256_unpackhi_epi16(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < 4; ++m) {
      v[8 * h + 2 * m] = _mm256_unpacklo_epi32(u[8 * h + m], u[8 * h + 4 + m]);
      v[8 * h + 2 * m + 1] = _mm256_unpackhi_epi32(u[8 * h + m], u[8 * h + 4 + m]);
    }
  for (int m = 0; m < 8; ++m) {
    r[2 * m] = _mm256_unpacklo_epi64(v[m], v[8 + m]);
    r[2 * m + 1] = _mm256_unpackhi_epi64(v[m], v[8 + m]);
  }
}

// Sixteen regular columns from c, with half_k a multiple of 32.
MOESTREAM_AVX2 static void repack_16_columns(const uint8_t* src, uint8_t* dst, int64_t half_k, const int64_t* lo,
                                             const int64_t* hi, int64_t offset, int64_t w) {
  const __m256i low = _mm256_set1_epi8(0x0F), high = _mm256_set1_epi8(static_cast<char>(0xF0));
  for (int64_t j = 0; j < half_k; j += 32) {
    __m256i even[16], odd[16];  // inputs 2j.. and 2j+1.. of each column
    for (int t = 0; t < 16; ++t) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + lo[t] * half_k + j));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + hi[t] * half_k + j));
      even[t] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(b, 4), high));
      odd[t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(b, high));
    }
    transpose16(even);
    transpose16(odd);
    for (int u = 0; u < 16; ++u) {
      for (int lane = 0; lane < 2; ++lane) {
        const int64_t k = 2 * (j + 16 * lane + u);
        const __m128i e = lane ? _mm256_extracti128_si256(even[u], 1) : _mm256_castsi256_si128(even[u]);
        const __m128i o = lane ? _mm256_extracti128_si256(odd[u], 1) : _mm256_castsi256_si128(odd[u]);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + offset + k * w), e);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + offset + (k + 1) * w), o);
      }
    }
  }
}
#endif

static void repack_range(const uint8_t* s, uint8_t* d, int64_t half_k, const int64_t* lp, const int64_t* hp, const int64_t* op,
                         const int64_t* sp, int64_t c0, int64_t c1) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (__builtin_cpu_supports("avx2") && half_k % 32 == 0) {
    for (int64_t c = c0; c < c1; c += 16) {
      bool regular = c + 16 <= c1;
      for (int t = 1; t < 16 && regular; ++t) regular = op[c + t] == op[c] + t && sp[c + t] == sp[c];
      if (regular)
        repack_16_columns(s, d, half_k, lp + c, hp + c, op[c], sp[c]);
      else
        repack_columns(s, d, half_k, lp, hp, op, sp, c, std::min(c + 16, c1));
    }
    return;
  }
#endif
  repack_columns(s, d, half_k, lp, hp, op, sp, c0, c1);
}

// In place: w [N, K/2] uint8; lo, hi, offset, stride [N/2] int64; blocks [B, 4] int64, each (first column,
// end column, first byte, end byte): the columns of a block read only the rows stored in its bytes and
// write only into them (torch lays out blocks of rows one after another), so each block is repacked into
// a small scratch buffer and copied back while it is still in cache. Runs on the calling thread only (an
// I/O thread, with the GIL released: the model's compute threads are not taken).
void repack_int4(torch::Tensor w, torch::Tensor lo, torch::Tensor hi, torch::Tensor offset, torch::Tensor stride, torch::Tensor blocks) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "repack_int4: w must be contiguous uint8 [N, K/2]");
  const int64_t n = w.size(0), half_k = w.size(1), columns = n / 2;
  for (const auto* t : {&lo, &hi, &offset, &stride})
    TORCH_CHECK(t->numel() == columns && t->is_contiguous() && t->scalar_type() == at::kLong,
                "repack_int4: lo, hi, offset and stride contiguous int64, one per pair of rows");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == 4 && blocks.is_contiguous() && blocks.scalar_type() == at::kLong,
              "repack_int4: blocks [B, 4] int64");
  uint8_t* d = w.data_ptr<uint8_t>();
  const int64_t *lp = lo.data_ptr<int64_t>(), *hp = hi.data_ptr<int64_t>(), *op = offset.data_ptr<int64_t>(), *sp = stride.data_ptr<int64_t>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  thread_local std::vector<uint8_t> scratch;
  thread_local std::vector<int64_t> shifted;  // the block's offsets and rows, relative to its first byte and row
  for (int64_t b = 0; b < blocks.size(0); ++b) {
    const int64_t c0 = bp[4 * b], c1 = bp[4 * b + 1], first = bp[4 * b + 2], end = bp[4 * b + 3];
    TORCH_CHECK(0 <= c0 && c0 <= c1 && c1 <= columns && 0 <= first && first <= end && end <= n * half_k && first % half_k == 0,
                "repack_int4: a block outside the matrix");
    const int64_t count = c1 - c0, row0 = first / half_k;
    scratch.resize(end - first);
    shifted.resize(3 * count);
    for (int64_t c = 0; c < count; ++c) {
      TORCH_CHECK(lp[c0 + c] >= row0 && hp[c0 + c] >= row0 && (std::max(lp[c0 + c], hp[c0 + c]) + 1) * half_k <= end &&
                      op[c0 + c] >= first && op[c0 + c] + (2 * half_k - 1) * sp[c0 + c] < end,
                  "repack_int4: a column outside its block");
      shifted[c] = lp[c0 + c] - row0;
      shifted[count + c] = hp[c0 + c] - row0;
      shifted[2 * count + c] = op[c0 + c] - first;
    }
    repack_range(d + first, scratch.data(), half_k, shifted.data(), shifted.data() + count, shifted.data() + 2 * count, sp + c0, 0, count);
    std::memcpy(d + first, scratch.data(), end - first);
  }
}

// Every kernel runs without the GIL (it touches no Python object): the model's thread computing a layer
// must not hold up the I/O threads, which need the GIL to finish a read and start the next one
// (docs/DECISIONS.md, "Kernels without the GIL").
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, no_gil);
  m.def("rotary", &rotary, no_gil);
  m.def("silu_gate", &silu_gate, no_gil);
  m.def("experts_decode", &experts_decode, no_gil);
  m.def("softmax_topk_router", &softmax_topk_router, no_gil);
  m.def("attention_decode_qkv", &attention_decode_qkv, no_gil);
  m.def("attention_decode_out", &attention_decode_out, no_gil);
  m.def("int4_matmul", &int4_matmul, no_gil);
  m.def("int8_matmul", &int8_matmul, no_gil);
  m.def("table_matmul", &table_matmul, no_gil);
  m.def("lowbit_isa", &lowbit_isa);
  m.def("decode_attention", &decode_attention, no_gil);
  m.def("decode_attention_simd", &decode_attention_simd);
  m.def("repack_int4", &repack_int4, no_gil);
  m.def("repair_nibbles", &repair_nibbles, no_gil);
  m.def("q6_k_int8", &q6_k_int8, no_gil);
  m.def("q6_k_int4", &q6_k_int4, no_gil);
}
