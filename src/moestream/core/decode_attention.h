// Attention for one query position per row (a decode step) over a long KV cache, reading each key and value
// once for the whole group of query heads that shares it (grouped-query attention), the positions split
// into pieces that run on different threads and are merged exactly by their log-sum-exp (flash-decoding).
//
// sdpa for one query expands or re-reads the keys per query head and slows with the context (4,096
// positions: 2.85 ms where three grouped torch ops take 1.14 ms, docs/BENCHMARKS.md, "Long context"); the
// bytes of K and V are the floor of a long-context decode step, and this reads them once.
//
// The arithmetic, per row b, query head h (KV head h / G) and its positions t:
//   s_t = scale * (q_h . k_t) + mask_t;  m = max_t s_t;  p_t = exp(s_t - m);  o_h = sum_t p_t v_t / sum_t p_t
// in float32, keys and values read in their dtype (float32 or bf16) and widened. A piece of positions
// keeps its own m_i, l_i = sum p_t and a_i = sum p_t v_t; the pieces merge as m = max m_i,
// l = sum l_i e^(m_i - m), o = sum a_i e^(m_i - m) / l. Sums run in another order than sdpa's, and exp is a
// polynomial (within 2 ulp of expf over the range it sees), so the result differs from sdpa's in the last
// bits: models run it only where it is registered as their attention (core/attention.py), and `eval`
// prices it against sdpa.
//
// Pure C++ on raw pointers; the loops are written so that the compiler vectorizes them, and each function
// that runs them is compiled for AVX-512, AVX2 and any x86-64 (target_clones), the CPU picking at load.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace flash_decode {

// fp-contract=fast: this kernel's sums are its own (no bit-exact twin to match), so a multiply and an add
// may fuse, which halves the arithmetic of both products.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DECODE_ATTENTION_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#else
#define DECODE_ATTENTION_CLONES
#endif

// Where the keys, values and mask lie: element (b, head, t, d) of K at b * k_batch + head * k_head +
// t * k_pos + d (d contiguous), V likewise; the additive mask (0 or -inf) at b * mask_batch + t, or none.
struct Layout {
  int64_t rows, heads, kv_heads, positions, dim;
  int64_t k_batch, k_head, k_pos, v_batch, v_head, v_pos;
  int64_t mask_batch;
};

inline float widen(float x) { return x; }
inline float widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// exp(x) for x <= 0 (a score minus the largest), 0 below -87 (exp underflows there, and -inf is a masked
// position): Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial in r (Cephes'
// expf coefficients), times 2^n built in the exponent bits. Branch-free, so a loop over it vectorizes.
inline float exp_nonpositive(float x) {
  const bool underflow = !(x > -87.0f);  // (also NaN: a row whose every position is masked)
  x = underflow ? 0.0f : x;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r) * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflow ? 0.0f : p * scale;
}

// One piece: positions t0..t1 of row b against the G query heads of KV head kv (their queries q [G, D],
// already scaled). Writes the piece's max m[G], sum l[G] and weighted values acc[G, D]; `scores` has room
// for G * (t1 - t0) floats and `row` for D.
template <typename T>
__attribute__((always_inline)) inline void piece(const Layout& s, const float* q, const T* k, const T* v, const float* mask, int64_t b,
                                                 int64_t kv, int64_t t0, int64_t t1, float* m, float* l, float* acc, float* scores,
                                                 float* row) {
  const int64_t G = s.heads / s.kv_heads, D = s.dim, n = t1 - t0;
  const T* keys = k + b * s.k_batch + kv * s.k_head;
  const T* values = v + b * s.v_batch + kv * s.v_head;
  for (int64_t t = 0; t < n; ++t) {  // each key read once, for every query head of the group
    const T* key = keys + (t0 + t) * s.k_pos;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = widen(key[d]);
    const float bias = mask ? mask[b * s.mask_batch + t0 + t] : 0.0f;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {  // four query heads per pass over the key: it is loaded once for them
      const float *q0 = q + g * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
      float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
      for (int64_t d = 0; d < D; ++d) {
        d0 += q0[d] * row[d], d1 += q1[d] * row[d];
        d2 += q2[d] * row[d], d3 += q3[d] * row[d];
      }
      scores[g * n + t] = d0 + bias, scores[(g + 1) * n + t] = d1 + bias;
      scores[(g + 2) * n + t] = d2 + bias, scores[(g + 3) * n + t] = d3 + bias;
    }
    for (; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
      scores[g * n + t] = dot + bias;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < n; ++t) top = std::max(top, sg[t]);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] = exp_nonpositive(sg[t] - top);
    // In order, not by vector lanes: a padded row's positions sit at other offsets of its piece than alone,
    // and its masked ones add exact zeros, so its sum is the same float as alone only if taken in order.
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) sum += sg[t];
    m[g] = top, l[g] = sum;
    std::fill(acc + g * D, acc + (g + 1) * D, 0.0f);
  }
  for (int64_t t = 0; t < n; ++t) {  // each value read once
    const T* value = values + (t0 + t) * s.v_pos;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = widen(value[d]);
    int64_t g = 0;
    for (; g + 2 <= G; g += 2) {  // the value loaded once for two heads
      const float p0 = scores[g * n + t], p1 = scores[(g + 1) * n + t];
      float *a0 = acc + g * D, *a1 = a0 + D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a0[d] += p0 * row[d], a1[d] += p1 * row[d];
    }
    for (; g < G; ++g) {
      const float p = scores[g * n + t];
      float* ag = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
    }
  }
}

DECODE_ATTENTION_CLONES inline void piece_float(const Layout& s, const float* q, const float* k, const float* v, const float* mask, int64_t b,
                                                int64_t kv, int64_t t0, int64_t t1, float* m, float* l, float* acc, float* scores, float* row) {
  piece<float>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
}

DECODE_ATTENTION_CLONES inline void piece_bf16(const Layout& s, const float* q, const uint16_t* k, const uint16_t* v, const float* mask,
                                               int64_t b, int64_t kv, int64_t t0, int64_t t1, float* m, float* l, float* acc, float* scores,
                                               float* row) {
  piece<uint16_t>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
}

// The pieces of one (row, query head) merged: m[i], l[i], acc[i * stride .. + D] for pieces i -> out [D].
inline void merge(int64_t pieces, const float* m, const float* l, const float* acc, int64_t stride, int64_t D, float* out) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < pieces; ++i) top = std::max(top, m[i]);
  std::fill(out, out + D, 0.0f);
  float total = 0.0f;
  for (int64_t i = 0; i < pieces; ++i) {
    if (!(m[i] > -std::numeric_limits<float>::infinity())) continue;  // a piece whose every position is masked
    const float w = std::exp(m[i] - top);
    total += w * l[i];
    for (int64_t d = 0; d < D; ++d) out[d] += w * acc[i * stride + d];
  }
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  for (int64_t d = 0; d < D; ++d) out[d] *= inverse;
}

}  // namespace flash_decode
