// Passes of the GGUF import (conversion/gguf_blocks.py calls them where the kernels are built): 4-bit
// codes re-paired into the store's portable nibbles, and Q6_K rows made int8 or int4 in one pass.
// Part of fused_kernels.cpp (fused_build inlines it there).

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
