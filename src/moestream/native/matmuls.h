// The matmuls the engine and the dense layers run on the CPU: int8 activations against low-bit weights
// (lowbit_dot.h) as torch tensors, the experts' SiLU gate and one token through a layer's experts
// (experts_decode), a resident linear (project), and the int4 codes repacked into torch's kernel layout.
// Part of fused_kernels.cpp (fused_build inlines it there).

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
  thread_local lowbit::GemmInputs mine;  // many activation rows (a prefill): the blocked loops (lowbit_gemm.h)
  lowbit::GemmInputs& in = mine;         // (by name, the threads below would each see their own)
  const bool gemm = lowbit::int4_gemm_applies(a, table);
  if (gemm) lowbit::prepare_int4(a, in);
  return over_rows(a, n, 8, w.size(1), dtype, [&](int64_t b, int64_t e, float* y) {
    if (gemm)
      lowbit::int4_gemm(a, in, wp, sp, static_cast<int>(bits), n, b, e, y);
    else
      lowbit::int4_rows(a, wp, sp, static_cast<int>(bits), n, b, e, y, table);
  });
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
  thread_local lowbit::GemmInputs mine;
  lowbit::GemmInputs& in = mine;
  const bool gemm = lowbit::int8_gemm_applies(a);
  if (gemm) lowbit::prepare_int8(a, in);
  return over_rows(a, n, 1, a.k, dtype, [&](int64_t b, int64_t e, float* y) {
    if (gemm)
      lowbit::int8_gemm(a, in, wp, sp, bf16, n, b, e, y);
    else
      lowbit::int8_rows(a, wp, sp, bf16, n, b, e, y);
  });
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

// The number of activation rows from which the int8-activation matmuls run the blocked loops of
// lowbit_gemm.h (where the matrix's variant has them); with `rows` > 0, that number from now on (the tests
// and benchmarks compare the two loops). Returns the number before the call.
int64_t lowbit_gemm_rows(int64_t rows) {
  const int64_t previous = lowbit::gemm_rows();
  if (rows > 0) lowbit::gemm_rows() = rows;
  return previous;
}

// The variant of the int8-activation loops that a matrix of `bits` (8: int8; else the int4 family), `group`
// and K inputs runs (`int4_variant`, `int8_variant`): what core/compute/plan.py reports per layer.
std::string lowbit_variant(int64_t bits, int64_t group, int64_t k) {
  const lowbit::Isa variant = bits == 8 ? lowbit::int8_variant(k) : lowbit::int4_variant(group, k);
  return kIsaNames[static_cast<int>(variant)];
}

// What `project` runs for a matrix: the kernel its plan chose at load (kernels.py, `matmul_kernel`), by the
// codes of kernels.py's `compiled_kernel`. The C++ does not choose again.
enum MatmulKernel : int64_t {
  kFloatWeight = 0,        // at::linear on a float weight
  kInt8Activations = 1,    // the int8-activation loops (int8, the int4 family's portable bytes, a table format)
  kTorchInt8 = 2,          // torch's int8 kernel
  kTorchInt8InFloat32 = 3, // the same in float32 (bf16 activations at widths torch's bf16 path gets wrong)
  kTorchInt4 = 4,          // torch's int4 kernel on its own layout, bf16 activations
  kTorchInt4ThroughBf16 = 5,  // the same for float32 or fp16 activations, cast to bf16 and back
};

// A matrix without bias as kernels.py runs it on the CPU, x [M, K] -> [M, N], for an expert's matmuls and a
// resident linear alike, with the `kernel` its plan chose.
static torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& params, int64_t kernel, int64_t bits,
                             int64_t group, const int8_t* table = nullptr) {
  TORCH_CHECK(table == nullptr || kernel == kInt8Activations, "a table format runs with int8 activations only");
  switch (kernel) {
    case kFloatWeight:
      return at::linear(x, w);
    case kInt8Activations:
      return integer_matmul(x, w, params, bits, group, table);
    case kTorchInt8:
      return at::_weight_int8pack_mm(x, w, params.scalar_type() == x.scalar_type() ? params : params.to(x.scalar_type()));
    case kTorchInt8InFloat32:
      return at::_weight_int8pack_mm(x.to(at::kFloat), w, params.to(at::kFloat)).to(x.scalar_type());
    case kTorchInt4:
      return at::_weight_int4pack_mm_for_cpu(x, w, group, params);
    case kTorchInt4ThroughBf16:
      return at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w, group, params).to(x.scalar_type());
  }
  TORCH_CHECK(false, "project: no kernel ", kernel);
}

// One token through n quantized experts with the SiLU gate: x [1, H]; per expert its first matrix (gate
// and up stacked, [2I, H]) and second ([H, I]) in torch's CPU kernels' layouts (bits 4: the int4 kernel
// with `group`; 8: the int8 kernel) -> [n, H], row j expert j's output. The same kernels the engine calls
// one op at a time, without the dispatch between them.
// `first_kernel` and `second_kernel`: the kernels the layer's plan chose for the two matrices (`MatmulKernel`;
// both int8-activation ones or neither). With `table` (int8 activations): the matrices are a 4-bit table
// format's (quant.py), these its 16 values.
// With `weights` [n, 1]: instead the weighted sum over the experts [1, H], as the engine computes it (its
// rows multiplied in place, then summed), one call for a whole one-token experts call.
torch::Tensor experts_decode(torch::Tensor x, std::vector<torch::Tensor> first, std::vector<torch::Tensor> first_params,
                             std::vector<torch::Tensor> second, std::vector<torch::Tensor> second_params, int64_t bits, int64_t group,
                             int64_t first_kernel, int64_t second_kernel, c10::optional<torch::Tensor> weights,
                             c10::optional<torch::Tensor> table) {
  const int64_t n = static_cast<int64_t>(first.size());
  TORCH_CHECK(n > 0 && first_params.size() == first.size() && second.size() == first.size() && second_params.size() == first.size(),
              "experts_decode: one first and one second matrix per expert");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.is_contiguous(), "experts_decode: x must be one contiguous row [1, H]");
  const bool integer = first_kernel == kInt8Activations;
  TORCH_CHECK(integer == (second_kernel == kInt8Activations), "experts_decode: int8 activations for both matrices or neither");
  TORCH_CHECK(bits == 4 || bits == 8 || (bits == 6 && integer), "experts_decode: 4 or 8 bits (6 with int8 activations)");
  const int8_t* values = table_values(table);  // a 4-bit table format (int8 activations only), or null
  TORCH_CHECK(values == nullptr || (integer && bits == 4 && group == lowbit::kBlock), "experts_decode: a table format takes int8 activations");
  thread_local lowbit::Activations shared;  // with `integer`: x quantized once for every expert's first matrix
  lowbit::Activations& xq = shared;           // (this thread's: the lambda below may run on others)
  if (integer) quantize_for(x, bits, group, xq);
  std::vector<torch::Tensor> ys(n);
  auto expert = [&](int64_t j) {
    auto h = integer ? against(xq, first[j], first_params[j], bits, x.scalar_type(), values)
                     : project(x, first[j], first_params[j], first_kernel, bits, group);
    auto a = torch::empty({1, h.size(1) / 2}, h.options());
    silu_gate_into(h, a);
    ys[j] = project(a, second[j], second_params[j], second_kernel, bits, group, values);
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

// out[positions[j]] = y[j] * weights[positions[j]] for an expert's rows: what
// out.index_copy_(0, positions, at::mul(y, weights.index_select(0, positions).unsqueeze(1)).to(out's dtype))
// computes, in one pass (index_copy_ alone took about a tenth of a prompt's experts). torch multiplies float32
// and bf16 in float32 and rounds to nearest even, which c10::BFloat16 does too; a product of two bf16 tensors
// is bf16 before it is cast to out's dtype. Returns false, doing nothing, for the dtypes it does not cover.
static bool scatter_weighted(const torch::Tensor& y, const torch::Tensor& positions, const torch::Tensor& weights, torch::Tensor& out) {
  const auto covered = [](const torch::Tensor& t) { return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16; };
  if (!covered(y) || !covered(weights) || !covered(out) || y.dim() != 2 || y.size(1) != out.size(1) || positions.scalar_type() != at::kLong)
    return false;
  const auto rows = y.contiguous();
  const auto at_rows = positions.contiguous();
  const auto w = weights.contiguous();
  const bool both_bf16 = y.scalar_type() == at::kBFloat16 && weights.scalar_type() == at::kBFloat16;
  const int64_t n = rows.size(0), H = rows.size(1);
  const int64_t* p = at_rows.data_ptr<int64_t>();
  const auto value = [](const torch::Tensor& t, int64_t i) {
    return t.scalar_type() == at::kFloat ? t.data_ptr<float>()[i] : static_cast<float>(t.data_ptr<c10::BFloat16>()[i]);
  };
  std::vector<float> row(H);
  for (int64_t j = 0; j < n; ++j) {
    const float weight = value(w, p[j]);
    if (rows.scalar_type() == at::kFloat) {
      const float* src = rows.data_ptr<float>() + j * H;
      for (int64_t d = 0; d < H; ++d) row[d] = src[d] * weight;
    } else {
      const c10::BFloat16* src = rows.data_ptr<c10::BFloat16>() + j * H;
      for (int64_t d = 0; d < H; ++d) row[d] = static_cast<float>(src[d]) * weight;
    }
    if (both_bf16)
      for (int64_t d = 0; d < H; ++d) row[d] = static_cast<float>(c10::BFloat16(row[d]));
    if (out.scalar_type() == at::kFloat)
      std::memcpy(out.data_ptr<float>() + p[j] * H, row.data(), H * sizeof(float));
    else {
      c10::BFloat16* dst = out.data_ptr<c10::BFloat16>() + p[j] * H;
      for (int64_t d = 0; d < H; ++d) dst[d] = c10::BFloat16(row[d]);
    }
  }
  return true;
}

// A prompt's tokens through n quantized experts, each expert on the rows routed to it, as the engine's
// general path computes them one op at a time (engine.py, `_LayerCall.compute`): x [T, H] (the layer's
// hidden states), rows[j] the positions t * k + c routed to expert j (int64), weights [T * k] the router's
// weights; out [T * k, H] gets row p = (expert(x[p / k]) * weights[p]) in out's dtype. The matrices and
// kernels as experts_decode takes them (one kernel for both, or int8 activations for both).
// The experts run whole on one thread each, taken from a shared counter (their row counts differ): the ops
// inside run serially (nested in torch's parallel region), with no fork and join per matmul and none of the
// Python between the ops; every op is the one the general path calls, so the numbers are its own.
void experts_prefill(torch::Tensor x, std::vector<torch::Tensor> rows, std::vector<torch::Tensor> first, std::vector<torch::Tensor> first_params,
                     std::vector<torch::Tensor> second, std::vector<torch::Tensor> second_params, int64_t bits, int64_t group, int64_t first_kernel,
                     int64_t second_kernel, torch::Tensor weights, torch::Tensor out, int64_t k, c10::optional<torch::Tensor> table) {
  const int64_t n = static_cast<int64_t>(first.size());
  TORCH_CHECK(rows.size() == first.size() && first_params.size() == first.size() && second.size() == first.size() &&
                  second_params.size() == first.size(),
              "experts_prefill: rows, a first and a second matrix per expert");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && out.size(0) == x.size(0) * k && out.size(1) == x.size(1) && out.is_contiguous() &&
                  weights.numel() == out.size(0),
              "experts_prefill: x [T, H], out [T * k, H] contiguous, weights [T * k]");
  TORCH_CHECK((first_kernel == kInt8Activations) == (second_kernel == kInt8Activations), "experts_prefill: int8 activations for both or neither");
  const int8_t* values = table_values(table);
  const auto flat_weights = weights.reshape({-1});
  std::vector<int64_t> order(n);  // the most rows first, so that the last expert taken is a small one
  for (int64_t j = 0; j < n; ++j) order[j] = j;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return rows[a].numel() > rows[b].numel(); });
  std::atomic<int64_t> next{0};
  auto expert = [&](int64_t j) {
    const auto& positions = rows[j];
    auto xs = x.index_select(0, at::floor_divide(positions, k));
    auto h = project(xs, first[j], first_params[j], first_kernel, bits, group, values);
    auto a = torch::empty({h.size(0), h.size(1) / 2}, h.options());
    silu_gate_into(h, a);
    auto y = project(a, second[j], second_params[j], second_kernel, bits, group, values);
    if (!scatter_weighted(y, positions, flat_weights, out))
      out.index_copy_(0, positions, at::mul(y, flat_weights.index_select(0, positions).unsqueeze(1)).to(out.scalar_type()));
  };
  const at::ThreadLocalState caller;  // inference mode and the like: the ops on other threads run as on this one
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard same(caller);
    for (int64_t i = next++; i < n; i = next++) expert(order[i]);
  });
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
  if (cpu::features().avx2_fma && half_k % 32 == 0) {
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
