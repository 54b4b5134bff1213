// A prompt's attention (many query positions at once) with AVX-512: blocked flash attention, causal blocks
// skipped, the keys and values of a KV head read once per block of query rows for every query head that shares
// them (grouped-query attention). bf16 with AVX-512 BF16's dot products (vdpbf16ps: 32 bf16 pairs multiplied
// into float32 sums), or float32 with fused multiply-adds.
//
// Why: at 4k tokens of prompt at the Qwen3-30B-A3B shape, torch's CPU sdpa (its flash kernel) took about half
// of a bf16 prefill's time, at a fraction of what the CPU's dot products can do (docs/BENCHMARKS.md, "Prefill
// attention"); a bf16 model computes in float32 on an AVX-512 CPU without BF16 (Skylake to Ice Lake), where
// torch's float32 kernel used a fraction of the FMA units.
//
// The arithmetic, per query row r (a position i and one query head) and its keys t <= its last key:
//   s_t = scale * (q_r . k_t) (products summed in float32); for each block of 64 keys the running max m, the
//   sum l and the output o are updated as m' = max(m, max_t s_t), a = exp(m - m'), p_t = exp(s_t - m'),
//   l' = l a + sum_t p_t, o' = o a + sum_t p_t v_t; at the end o / l.
// In bf16 the weights p_t are rounded to bf16 for the values' dot products (as torch's bf16 flash kernel does).
// The sums run in another order than sdpa's and exp is decode_attention.h's polynomial: the output differs from
// sdpa's in the last bits of its dtype (tests/test_attention.py bounds it against float64; `moestream eval
// --attention sdpa` prices it).
//
// Layouts: the keys of a KV head are repacked once per call so that one 512-bit load gives 16 keys at one
// dimension: [blocks of 16 keys][D/2][16 keys][2] in bf16 (a (d, d+1) pair per key), [..][D][16 keys] in float32;
// the values in bf16 as [key pairs][D][2] (one load: 16 outputs' (t, t+1) pairs), in float32 as rows [T][D]. A
// query row's element (or bf16 pair) and a weight (or pair) are broadcast.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

// (cpu_features.h comes before this file in fused_kernels.cpp.)
namespace flash_prefill {

constexpr int64_t kKeys = 64;      // keys per block: four 16-lane vectors of scores per query row
constexpr int64_t kScoreRows = 6;  // query rows per scores tile: 6 x 4 accumulators
constexpr int64_t kValueRows = 3;  // query rows per values tile: 3 x 8 accumulators (128 outputs)
constexpr int64_t kTaskRows = 96;  // query rows (positions x the group's heads) a thread takes at a time

// A switch the tests turn the kernel off by (prompts then run sdpa, as on a CPU without it).
inline bool& enabled() {
  static bool on = true;
  return on;
}
// Whether this CPU runs the kernel for bf16 (AVX-512 with BF16's dot products) or float32 (AVX-512).
inline bool available(bool bf16) { return enabled() && (bf16 ? cpu::features().avx512_bf16 : cpu::features().avx512); }

// What a call computes: q [B, H, Q, D], k and v [B, KVH, T, D] (all bf16 or all float32, d contiguous, any other
// strides), and for query position i of row b its keys 0..limit: T - Q + i when causal, else T - 1; a mask
// (bytes, true attends) at mask + b * mask_batch + i * mask_query + t further limits them. out: [B, Q, H, D].
template <typename T>
struct Problem {
  int64_t rows, heads, kv_heads, queries, positions, dim;
  const T *q, *k, *v;
  int64_t q_batch, q_head, q_pos, k_batch, k_head, k_pos, v_batch, v_head, v_pos;
  const uint8_t* mask;
  int64_t mask_batch, mask_query;
  bool causal;
  float scale;
  T* out;
};

#if defined(__x86_64__) && defined(__GNUC__)
#define PREFILL_ATTENTION_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))
#define PREFILL_ATTENTION_BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,fma")))

// decode_attention.h's exp_nonpositive on 16 lanes: exp(x) for x <= 0, 0 below -87 and for NaN (a row
// with every key masked so far: -inf minus -inf).
PREFILL_ATTENTION_AVX512 inline __m512 exp_nonpositive16(__m512 x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  x = _mm512_maskz_mov_ps(ok, x);
  const __m512 shift = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shift), shift);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, p, _mm512_castsi512_ps(bits));
}

// ---- bf16: the tiles with BF16's dot products ----------------------------------------------------------------

PREFILL_ATTENTION_BF16 inline __m512bh pair_of(const uint16_t* p) {
  int32_t two;
  std::memcpy(&two, p, sizeof(two));
  return (__m512bh)_mm512_set1_epi32(two);
}

// Scores of kScoreRows query rows against one block of 64 keys: rows [kScoreRows][D] bf16, keys the block's
// four 16-key chunks (each [D/2][16][2]) -> scores [kScoreRows][64] in float32, unscaled.
PREFILL_ATTENTION_BF16 __attribute__((noinline)) void scores_tile(const uint16_t* rows, const uint16_t* keys, int64_t D, float* scores) {
  __m512 acc[kScoreRows][4];
  for (int64_t r = 0; r < kScoreRows; ++r)
    for (int64_t c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t chunk = 16 * D;  // bf16 elements of a 16-key chunk
  for (int64_t j = 0; j < D / 2; ++j) {
    __m512bh key[4];
    for (int64_t c = 0; c < 4; ++c) key[c] = (__m512bh)_mm512_loadu_si512(keys + c * chunk + 32 * j);
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const __m512bh q = pair_of(rows + r * D + 2 * j);
      for (int64_t c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], key[c], q);
    }
  }
  for (int64_t r = 0; r < kScoreRows; ++r)
    for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(scores + r * kKeys + 16 * c, acc[r][c]);
}

// o [kValueRows][D] (float32, outputs d0 .. d0 + 16 C) = o * alpha + weights . values over one block of
// 64 keys: weights [kValueRows][64] bf16, values the block's 32 key pairs (each [D][2]).
template <int64_t C>
PREFILL_ATTENTION_BF16 inline void values_tile(const uint16_t* weights, const uint16_t* values, const float* alpha, int64_t D, int64_t d0,
                                               float* o) {
  __m512 acc[kValueRows][C];
  for (int64_t r = 0; r < kValueRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * c), a);
  }
  for (int64_t pair = 0; pair < kKeys / 2; ++pair) {
    __m512bh value[C];
    for (int64_t c = 0; c < C; ++c) value[c] = (__m512bh)_mm512_loadu_si512(values + pair * 2 * D + 2 * (d0 + 16 * c));
    for (int64_t r = 0; r < kValueRows; ++r) {
      const __m512bh w = pair_of(weights + r * kKeys + 2 * pair);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], value[c], w);
    }
  }
  for (int64_t r = 0; r < kValueRows; ++r)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
}

// A block's weights [rows][64] rounded to bf16 (to nearest even), then every row's values tiles.
PREFILL_ATTENTION_BF16 __attribute__((noinline)) void values_block(const float* weights, int64_t rows, const uint16_t* values,
                                                                   const float* alpha, int64_t D, float* o, uint16_t* rounded) {
  for (int64_t i = 0; i < rows * kKeys; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(weights + i)));
  for (int64_t r = 0; r < rows; r += kValueRows)
    for (int64_t d0 = 0; d0 < D; d0 += 128) {
      const uint16_t* w = rounded + r * kKeys;
      switch (std::min<int64_t>(128, D - d0) / 16) {
        case 8: values_tile<8>(w, values, alpha + r, D, d0, o + r * D); break;
        case 6: values_tile<6>(w, values, alpha + r, D, d0, o + r * D); break;
        case 4: values_tile<4>(w, values, alpha + r, D, d0, o + r * D); break;
        default: values_tile<2>(w, values, alpha + r, D, d0, o + r * D); break;
      }
    }
}

// The task's outputs o / l rounded to bf16 (to nearest even).
PREFILL_ATTENTION_BF16 __attribute__((noinline)) void store_row(const float* o, float inverse, int64_t D, uint16_t* out) {
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inverse))));
}

// ---- float32: the same tiles with fused multiply-adds ---------------------------------------------------------

// Scores as the bf16 tile's, keys in chunks of [D][16].
PREFILL_ATTENTION_AVX512 inline void scores_tile(const float* rows, const float* keys, int64_t D, float* scores) {
  __m512 acc[kScoreRows][4];
  for (int64_t r = 0; r < kScoreRows; ++r)
    for (int64_t c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t chunk = 16 * D;
  for (int64_t d = 0; d < D; ++d) {
    __m512 key[4];
    for (int64_t c = 0; c < 4; ++c) key[c] = _mm512_loadu_ps(keys + c * chunk + 16 * d);
    for (int64_t r = 0; r < kScoreRows; ++r) {
      const __m512 q = _mm512_set1_ps(rows[r * D + d]);
      for (int64_t c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(key[c], q, acc[r][c]);
    }
  }
  for (int64_t r = 0; r < kScoreRows; ++r)
    for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(scores + r * kKeys + 16 * c, acc[r][c]);
}

// As the bf16 tile, the values rows [64][D] and the weights in float32.
template <int64_t C>
PREFILL_ATTENTION_AVX512 inline void values_tile(const float* weights, const float* values, const float* alpha, int64_t D, int64_t d0,
                                                 float* o) {
  __m512 acc[kValueRows][C];
  for (int64_t r = 0; r < kValueRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + 16 * c), a);
  }
  for (int64_t t = 0; t < kKeys; ++t) {
    __m512 value[C];
    for (int64_t c = 0; c < C; ++c) value[c] = _mm512_loadu_ps(values + t * D + d0 + 16 * c);
    for (int64_t r = 0; r < kValueRows; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r * kKeys + t]);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(value[c], w, acc[r][c]);
    }
  }
  for (int64_t r = 0; r < kValueRows; ++r)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(o + r * D + d0 + 16 * c, acc[r][c]);
}

PREFILL_ATTENTION_AVX512 inline void values_block(const float* weights, int64_t rows, const float* values, const float* alpha, int64_t D,
                                                  float* o, float*) {
  for (int64_t r = 0; r < rows; r += kValueRows)
    for (int64_t d0 = 0; d0 < D; d0 += 128) {
      const float* w = weights + r * kKeys;
      switch (std::min<int64_t>(128, D - d0) / 16) {
        case 8: values_tile<8>(w, values, alpha + r, D, d0, o + r * D); break;
        case 6: values_tile<6>(w, values, alpha + r, D, d0, o + r * D); break;
        case 4: values_tile<4>(w, values, alpha + r, D, d0, o + r * D); break;
        default: values_tile<2>(w, values, alpha + r, D, d0, o + r * D); break;
      }
    }
}

PREFILL_ATTENTION_AVX512 inline void store_row(const float* o, float inverse, int64_t D, float* out) {
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inverse)));
}

// ---- the task: shared by both --------------------------------------------------------------------------------

// A thread's scratch for one task.
template <typename T>
struct Scratch {
  std::vector<T> rows;             // [rows][D] the task's queries
  std::vector<float> scores;       // [rows][64]
  std::vector<T> rounded;          // [rows][64] the weights in T, where the values' tiles take them so
  std::vector<float> o, m, l, alpha;
  std::vector<int64_t> last;              // each row's last key
  std::vector<const uint8_t*> mask_rows;  // each row's mask (or none)
};

// One task: positions i0 .. i1 of row b and the query heads of KV head kv, every row padded to a multiple of
// kScoreRows (copies of the first row, whose results are dropped). keys and values: that head's repacked ones.
// The scores become weights in place (s.scores).
template <typename T>
PREFILL_ATTENTION_AVX512 void task(const Problem<T>& p, int64_t b, int64_t kv, int64_t i0, int64_t i1, const T* keys, const T* values,
                                   Scratch<T>& s) {
  const int64_t G = p.heads / p.kv_heads, D = p.dim, real = (i1 - i0) * G;
  const int64_t rows = (real + kScoreRows - 1) / kScoreRows * kScoreRows;
  s.rows.resize(rows * D), s.scores.resize(rows * kKeys), s.rounded.resize(rows * kKeys);
  s.o.assign(rows * D, 0.0f), s.m.assign(rows, -std::numeric_limits<float>::infinity()), s.l.assign(rows, 0.0f), s.alpha.resize(rows);
  s.last.resize(rows), s.mask_rows.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = r < real ? r : 0, i = i0 + at / G, h = kv * G + at % G;
    std::memcpy(s.rows.data() + r * D, p.q + b * p.q_batch + h * p.q_head + i * p.q_pos, D * sizeof(T));
    s.last[r] = p.causal ? std::min(p.positions - 1, p.positions - p.queries + i) : p.positions - 1;
    s.mask_rows[r] = p.mask ? p.mask + b * p.mask_batch + i * p.mask_query : nullptr;
  }
  const int64_t fewest = *std::min_element(s.last.begin(), s.last.end()), most = *std::max_element(s.last.begin(), s.last.end());
  const __m512 scale = _mm512_set1_ps(p.scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t t0 = 0; t0 <= most; t0 += kKeys) {
    const int64_t n = std::min(kKeys, p.positions - t0);  // keys of this block that exist
    if (p.mask) {  // a block no row attends to is skipped
      bool any = false;
      for (int64_t r = 0; r < rows && !any; ++r)
        for (int64_t t = 0; t < n && !any; ++t) any = s.mask_rows[r][t0 + t] != 0;
      if (!any) continue;
    }
    const bool whole = !p.mask && fewest >= t0 + kKeys - 1;  // every row attends to every key of the block
    for (int64_t r = 0; r < rows; r += kScoreRows) scores_tile(s.rows.data() + r * D, keys + t0 * D, D, s.scores.data() + r * kKeys);
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s.scores.data() + r * kKeys;
      __m512 x[4];
      for (int64_t c = 0; c < 4; ++c) {
        x[c] = _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), scale);
        if (!whole) {
          const __m512i t = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(t0 + 16 * c)));
          __mmask16 keep = _mm512_cmple_epi32_mask(t, _mm512_set1_epi32(static_cast<int32_t>(std::min(s.last[r], t0 + n - 1))));
          if (s.mask_rows[r]) {
            const int64_t from = t0 + 16 * c, count = std::max<int64_t>(0, std::min<int64_t>(16, t0 + n - from));
            const __mmask16 in = count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
            const __m128i bytes = _mm_maskz_loadu_epi8(in, s.mask_rows[r] + from);
            keep &= _mm_cmpneq_epi8_mask(bytes, _mm_setzero_si128());
          }
          x[c] = _mm512_mask_mov_ps(minus_inf, keep, x[c]);
        }
      }
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
      const float m = std::max(s.m[r], top);
      const __m512 mv = _mm512_set1_ps(m);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t c = 0; c < 4; ++c) {
        const __m512 e = exp_nonpositive16(_mm512_sub_ps(x[c], mv));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(row + 16 * c, e);
      }
      const float alpha = _mm512_cvtss_f32(exp_nonpositive16(_mm512_set1_ps(s.m[r] - m)));
      s.alpha[r] = alpha, s.m[r] = m, s.l[r] = s.l[r] * alpha + _mm512_reduce_add_ps(sum);
    }
    values_block(s.scores.data(), rows, values + t0 * D, s.alpha.data(), D, s.o.data(), s.rounded.data());
  }
  for (int64_t r = 0; r < real; ++r) {
    const int64_t i = i0 + r / G, h = kv * G + r % G;
    store_row(s.o.data() + r * D, s.l[r] > 0.0f ? 1.0f / s.l[r] : 0.0f, D, p.out + ((b * p.queries + i) * p.heads + h) * D);
  }
}

// The keys of one KV head in chunks of 16 keys ([D/2][16][2] in bf16, [D][16] in float32) and its values ([key
// pairs][D][2] in bf16, rows [T][D] in float32), both padded with zeros to a whole number of 64-key blocks
// (padding is never attended: every row's last key is a real one).
template <typename T>
void repack(const Problem<T>& p, int64_t b, int64_t kv, int64_t padded, T* keys, T* values) {
  const int64_t D = p.dim;
  std::memset(keys, 0, padded * D * sizeof(T));
  std::memset(values, 0, padded * D * sizeof(T));
  for (int64_t t = 0; t < p.positions; ++t) {
    const T* key = p.k + b * p.k_batch + kv * p.k_head + t * p.k_pos;
    const T* value = p.v + b * p.v_batch + kv * p.v_head + t * p.v_pos;
    if constexpr (sizeof(T) == 2) {
      T* chunk = keys + (t / 16) * 16 * D + (t % 16) * 2;
      for (int64_t j = 0; j < D / 2; ++j) chunk[32 * j] = key[2 * j], chunk[32 * j + 1] = key[2 * j + 1];
      T* pair = values + (t / 2) * 2 * D + t % 2;
      for (int64_t d = 0; d < D; ++d) pair[2 * d] = value[d];
    } else {
      T* chunk = keys + (t / 16) * 16 * D + t % 16;
      for (int64_t d = 0; d < D; ++d) chunk[16 * d] = key[d];
      std::memcpy(values + t * D, value, D * sizeof(T));
    }
  }
}

// The whole call on `threads` workers (parallel(work) calls work once per worker, in parallel): repack each
// (row, KV head)'s keys and values, then tasks of kTaskRows query rows, the ones with the most keys first, taken
// from a shared counter (a causal prompt's last positions have many times its first ones' work).
template <typename T, typename Parallel>
void attention(const Problem<T>& p, Parallel&& parallel) {
  const int64_t G = p.heads / p.kv_heads, heads = p.rows * p.kv_heads;
  const int64_t padded = (p.positions + kKeys - 1) / kKeys * kKeys;
  std::vector<T> keys(heads * padded * p.dim), values(heads * padded * p.dim);
  std::atomic<int64_t> next{0};
  parallel([&](int64_t) {
    for (int64_t j = next++; j < heads; j = next++)
      repack(p, j / p.kv_heads, j % p.kv_heads, padded, keys.data() + j * padded * p.dim, values.data() + j * padded * p.dim);
  });
  const int64_t per_task = std::max<int64_t>(1, kTaskRows / G), blocks = (p.queries + per_task - 1) / per_task;
  std::atomic<int64_t> taken{0};
  parallel([&](int64_t) {
    Scratch<T> scratch;
    for (int64_t j = taken++; j < blocks * heads; j = taken++) {
      const int64_t block = blocks - 1 - j / heads, head = j % heads;  // the latest positions first
      const int64_t i0 = block * per_task, i1 = std::min(p.queries, i0 + per_task);
      task(p, head / p.kv_heads, head % p.kv_heads, i0, i1, keys.data() + head * padded * p.dim, values.data() + head * padded * p.dim,
           scratch);
    }
  });
}
#else
template <typename T, typename Parallel>
void attention(const Problem<T>&, Parallel&&) {}
#endif

}  // namespace flash_prefill
