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
// in float32, keys and values read in their dtype (float32 or bf16) and widened. An 8-bit cache (int8_t) holds
// each position's row of a head as D int8 codes followed by its float32 scale (absmax / 127): the row is the
// codes times the scale, which the keys' scores and the values' weights take once per row. A piece of positions
// keeps its own m_i, l_i = sum p_t and a_i = sum p_t v_t; the pieces merge as m = max m_i,
// l = sum l_i e^(m_i - m), o = sum a_i e^(m_i - m) / l. Sums run in another order than sdpa's, and exp is a
// polynomial (within 2 ulp of expf over the range it sees), so the result differs from sdpa's in the last
// bits: models run it only where it is registered as their attention (core/compute/attention.py), and `eval`
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
#include <type_traits>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace flash_decode {

// This kernel's sums are its own (no bit-exact twin to match): a multiply and an add may fuse, and a dot
// product's lanes may be added as a tree (associative-math, which needs the other two), rather than one
// lane after another, which took most of the time. What must keep its order does not live here (`in_order`).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define DECODE_ATTENTION_MATH optimize("fp-contract=fast", "associative-math", "no-signed-zeros", "no-trapping-math")
#define DECODE_ATTENTION_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), DECODE_ATTENTION_MATH))
#else
#define DECODE_ATTENTION_MATH
#define DECODE_ATTENTION_CLONES
#endif

// Where the keys, values and mask lie: element (b, head, t, d) of K at b * k_batch + head * k_head +
// t * k_pos + d (d contiguous; an 8-bit row's scale right after its D codes), V likewise; the additive mask
// (0 or -inf) at b * mask_batch + t, or none.
struct Layout {
  int64_t rows, heads, kv_heads, positions, dim;
  int64_t k_batch, k_head, k_pos, v_batch, v_head, v_pos;
  int64_t mask_batch;
};

inline float widen(float x) { return x; }
inline float widen(int8_t code) { return static_cast<float>(code); }
inline float widen(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// What a row of D elements is multiplied by: its float32 scale after the codes (8-bit), else 1.
template <typename T>
inline float row_scale(const T* row, int64_t D) {
  if constexpr (std::is_same_v<T, int8_t>) {
    float scale;
    std::memcpy(&scale, row + D, sizeof(scale));
    return scale;
  } else {
    return 1.0f;
  }
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

// The sum of x[0..n) added in order, not by vector lanes: a padded row's positions sit at other offsets of
// its piece than alone, and its masked ones add exact zeros, so its sum is the same float as alone only if
// taken in order. (Not inlined into the pieces, whose reassociating options would vectorize it.)
__attribute__((noinline)) inline float in_order(const float* x, int64_t n) {
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) sum += x[t];
  return sum;
}

#if defined(__x86_64__) && defined(__GNUC__)
#define DECODE_ATTENTION_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

// The most capable hand-written loops allowed: 2 AVX-512, 1 AVX2, 0 none (the compiler's loops alone). The
// tests lower it to run, on one CPU, what plainer CPUs run.
inline int& simd_cap() {
  static int cap = 2;
  return cap;
}

inline bool has_avx512() { return cpu::features().avx512 && simd_cap() >= 2; }

inline bool has_avx2() { return cpu::features().avx2_fma && simd_cap() >= 1; }

// As scores_avx512 with AVX2 (D a multiple of 8, G a multiple of 4): sixteen registers do not hold a widened
// key, so it is widened into `row` (in L1) and read from there for each four heads.
template <typename T>
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q, const T* keys, int64_t k_pos, int64_t n, int64_t G, int64_t D,
                                                     const float* bias, float* scores, float* row) {
  for (int64_t t = 0; t < n; ++t) {
    const T* key = keys + t * k_pos;
    const float scale = row_scale(key, D);
    for (int64_t d = 0; d < D; ++d) row[d] = widen(key[d]) * scale;
    const float b = bias ? bias[t] : 0.0f;
    for (int64_t g = 0; g < G; g += 4) {
      const float* qg = q + g * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 r = _mm256_loadu_ps(row + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), r, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + D + d), r, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 2 * D + d), r, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 3 * D + d), r, a3);
      }
      // pairs, then quads, within each 128-bit half; then the halves: (a0, a1, a2, a3)
      const __m256 quad = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      alignas(16) float dots[4];
      _mm_store_ps(dots, _mm_add_ps(_mm256_castps256_ps128(quad), _mm256_extractf128_ps(quad, 1)));
      for (int64_t i = 0; i < 4; ++i) scores[(g + i) * n + t] = dots[i] + b;
    }
  }
}

DECODE_ATTENTION_AVX512 inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
DECODE_ATTENTION_AVX512 inline __m512 widen16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
DECODE_ATTENTION_AVX512 inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The scores of a piece with AVX-512 (D a multiple of 16 up to 256, G a multiple of 4): each key widened
// once into registers, then four query heads at a time, their four dot products' lanes added as one tree
// (the loops the compiler writes add each product's 16 lanes one after another, which took most of the
// time). scores [G, n] (+ the mask's bias).
template <typename T>
DECODE_ATTENTION_AVX512 void scores_avx512(const float* q, const T* keys, int64_t k_pos, int64_t n, int64_t G, int64_t D, const float* bias,
                                           float* scores) {
  const int64_t chunks = D / 16;
  __m512 row[16];
  for (int64_t t = 0; t < n; ++t) {
    const T* key = keys + t * k_pos;
    for (int64_t c = 0; c < chunks; ++c) row[c] = widen16(key + 16 * c);
    if constexpr (std::is_same_v<T, int8_t>) {
      const __m512 scale = _mm512_set1_ps(row_scale(key, D));
      for (int64_t c = 0; c < chunks; ++c) row[c] = _mm512_mul_ps(row[c], scale);
    }
    const float b = bias ? bias[t] : 0.0f;
    for (int64_t g = 0; g < G; g += 4) {
      const float* qg = q + g * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < chunks; ++c) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), row[c], a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + D + 16 * c), row[c], a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 2 * D + 16 * c), row[c], a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 3 * D + 16 * c), row[c], a3);
      }
      // per 128-bit lane: (a0, a1 | even, odd halves) -> (a0, a1, a2, a3) partial sums -> across the lanes
      const __m512 h01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
      const __m512 h23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
      const __m512 quad = _mm512_add_ps(_mm512_shuffle_ps(h01, h23, 0x44), _mm512_shuffle_ps(h01, h23, 0xEE));
      const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(quad), _mm512_extractf32x8_ps(quad, 1));
      alignas(16) float dots[4];
      _mm_store_ps(dots, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
      for (int64_t i = 0; i < 4; ++i) scores[(g + i) * n + t] = dots[i] + b;
    }
  }
}

// The weighted values of a piece with AVX-512 (D a multiple of 16 up to 128, G even): two query heads at a
// time, their sums kept in registers across the piece's positions (the compiler's loop loads and stores
// them for every position), each value widened as it is read. acc [G, D] is overwritten.
template <typename T>
DECODE_ATTENTION_AVX512 void values_avx512(const float* weights, const T* values, int64_t v_pos, int64_t n, int64_t G, int64_t D,
                                           float* acc) {
  const int64_t chunks = D / 16;
  for (int64_t g = 0; g < G; g += 2) {
    __m512 a0[8], a1[8];
    for (int64_t c = 0; c < chunks; ++c) a0[c] = _mm512_setzero_ps(), a1[c] = _mm512_setzero_ps();
    const float *p0 = weights + g * n, *p1 = p0 + n;
    for (int64_t t = 0; t < n; ++t) {
      const T* value = values + t * v_pos;
      const float scale = row_scale(value, D);  // (the weights carry the row's scale)
      const __m512 w0 = _mm512_set1_ps(p0[t] * scale), w1 = _mm512_set1_ps(p1[t] * scale);
      for (int64_t c = 0; c < chunks; ++c) {
        const __m512 v = widen16(value + 16 * c);
        a0[c] = _mm512_fmadd_ps(w0, v, a0[c]);
        a1[c] = _mm512_fmadd_ps(w1, v, a1[c]);
      }
    }
    for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a0[c]), _mm512_storeu_ps(acc + (g + 1) * D + 16 * c, a1[c]);
  }
}
#endif

// One piece: positions t0..t1 of row b against the G query heads of KV head kv (their queries q [G, D],
// already scaled). Writes the piece's max m[G], sum l[G] and weighted values acc[G, D]; `scores` has room
// for G * (t1 - t0) floats and `row` for D.
// kDim: the head size as a constant (the common 64 and 128: loops of known length, unrolled), 0 for any.
template <typename T, int64_t kDim>
__attribute__((always_inline)) inline void piece(const Layout& s, const float* q, const T* k, const T* v, const float* mask, int64_t b,
                                                 int64_t kv, int64_t t0, int64_t t1, float* m, float* l, float* acc, float* scores,
                                                 float* row) {
  const int64_t G = s.heads / s.kv_heads, D = kDim > 0 ? kDim : s.dim, n = t1 - t0;
  const T* keys = k + b * s.k_batch + kv * s.k_head;
  const T* values = v + b * s.v_batch + kv * s.v_head;
  const float* bias = mask ? mask + b * s.mask_batch + t0 : nullptr;
#if defined(__x86_64__) && defined(__GNUC__)
  const bool wide = has_avx512() && D % 16 == 0 && D <= 256 && G % 4 == 0;
  const bool narrow = !wide && has_avx2() && D % 8 == 0 && G % 4 == 0;
  if (wide) scores_avx512<T>(q, keys + t0 * s.k_pos, s.k_pos, n, G, D, bias, scores);
  if (narrow) scores_avx2<T>(q, keys + t0 * s.k_pos, s.k_pos, n, G, D, bias, scores, row);
#else
  const bool wide = false, narrow = false;
#endif
  for (int64_t t = 0; t < n && !wide && !narrow; ++t) {  // each key read once, for every query head of the group
    const T* key = keys + (t0 + t) * s.k_pos;
    const float scale = row_scale(key, D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = widen(key[d]) * scale;
    const float b_t = bias ? bias[t] : 0.0f;
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {  // four query heads per pass over the key: it is loaded once for them
      const float *q0 = q + g * D, *q1 = q0 + D, *q2 = q1 + D, *q3 = q2 + D;
      float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
      for (int64_t d = 0; d < D; ++d) {
        d0 += q0[d] * row[d], d1 += q1[d] * row[d];
        d2 += q2[d] * row[d], d3 += q3[d] * row[d];
      }
      scores[g * n + t] = d0 + b_t, scores[(g + 1) * n + t] = d1 + b_t;
      scores[(g + 2) * n + t] = d2 + b_t, scores[(g + 3) * n + t] = d3 + b_t;
    }
    for (; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
      scores[g * n + t] = dot + b_t;
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    float top = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : top)
    for (int64_t t = 0; t < n; ++t) top = std::max(top, sg[t]);
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) sg[t] = exp_nonpositive(sg[t] - top);
    m[g] = top, l[g] = in_order(sg, n);
    std::fill(acc + g * D, acc + (g + 1) * D, 0.0f);
  }
#if defined(__x86_64__) && defined(__GNUC__)
  if (wide && D <= 128 && G % 2 == 0) return values_avx512<T>(scores, values + t0 * s.v_pos, s.v_pos, n, G, D, acc);
#endif
  for (int64_t t = 0; t < n; ++t) {  // each value read once
    const T* value = values + (t0 + t) * s.v_pos;
    const float scale = row_scale(value, D);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) row[d] = widen(value[d]) * scale;
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
  if (s.dim == 128) return piece<float, 128>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
  if (s.dim == 64) return piece<float, 64>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
  piece<float, 0>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
}

DECODE_ATTENTION_CLONES inline void piece_bf16(const Layout& s, const float* q, const uint16_t* k, const uint16_t* v, const float* mask,
                                               int64_t b, int64_t kv, int64_t t0, int64_t t1, float* m, float* l, float* acc, float* scores,
                                               float* row) {
  if (s.dim == 128) return piece<uint16_t, 128>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
  if (s.dim == 64) return piece<uint16_t, 64>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
  piece<uint16_t, 0>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
}

DECODE_ATTENTION_CLONES inline void piece_int8(const Layout& s, const float* q, const int8_t* k, const int8_t* v, const float* mask, int64_t b,
                                               int64_t kv, int64_t t0, int64_t t1, float* m, float* l, float* acc, float* scores, float* row) {
  if (s.dim == 128) return piece<int8_t, 128>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
  if (s.dim == 64) return piece<int8_t, 64>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
  piece<int8_t, 0>(s, q, k, v, mask, b, kv, t0, t1, m, l, acc, scores, row);
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
