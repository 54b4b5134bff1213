// Matmuls of low-bit weights against int8 activations, the arithmetic llama.cpp uses on CPUs: each row of
// activations is quantized to int8 once per call (one scale per block of 32 inputs, as llama.cpp's Q8_0),
// the dot products run in integers (AVX2: maddubs then madd, 32 products per instruction pair), and the two
// scales are applied per block at the end. torch's CPU int4 kernel instead dequantizes every weight to a
// float and multiplies; on a CPU without native bf16 that runs at half the memory bus (docs/BENCHMARKS.md, "int8-activation kernels against the memory bus").
//
// The arithmetic, exactly (kernels.py `int8_activation_reference` computes it in float64):
//   activations, per row and block b of 32 inputs: d_b = max|x| / 127, q_i = round_half_even(x_i * (1 / d_b))
//     (float32 operations; q = 0 where d_b = 0)
//   int4 family of b bits, W = (c - 8) s_g + z_g per group g of G inputs (quant.py), c the 0..2^b-1 codes,
//   written W = (c - C) s_g + (z_g - (8 - C) s_g) with C = 2^(b-1), the middle code:
//     y = sum_g [ s_g sum_{b in g} d_b sum_{i in b} (c_i - C) q_i  +  (z_g - (8 - C) s_g) sum_{i in g} x_i ]
//   (the second term takes the float activations: it costs nothing and drops that term's rounding; centred
//   codes keep the first term's small, so int2 and int3 lose no more to the activations' rounding than int4)
//   int8, W = c s per output channel: y = s sum_b d_b sum_{i in b} c_i q_i
//   int6 is the same formula with b = 6 (codes 0..63, C = 32); its rows add a plane of top bits (`row_bytes`)
//   a 4-bit table format (quant.py: MXFP4's e2m1 values, IQ4_NL's levels), W = T[c] s_g + z_g with T 16 int8
//   values: y = sum_g [ s_g sum_{b in g} d_b sum_{i in b} T[c_i] q_i  +  z_g sum_{i in g} x_i ]
// Sums over a block are exact integers; the sums over blocks and groups are float32, as is the result.
//
// Pure C++ on raw pointers: fused_kernels.cpp wraps these in torch tensors and splits the output rows
// across threads. Runtime dispatch (`isa()`): AVX-512 with VNNI where the CPU has it, else AVX2, else a
// portable loop; the same integer sums in each, the float sums over blocks in another order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace lowbit {

constexpr int64_t kBlock = 32;     // inputs per activation scale
constexpr int64_t kSuper = 64;     // inputs per 32 bytes of int4 codes: two blocks
constexpr int64_t kRowTile = 4;    // activation rows computed against one weight row while it is in registers
constexpr int64_t kWeightRows = 16;  // weight rows done for every activation row before the next ones
// Reads asked for ahead of use (a prefetch past a matrix's end never faults). The hardware's own prefetch
// follows the codes' one stream but not the scales' (one cache line per group, N * 4 bytes apart): asking
// for both made a DRAM-bound int4 g64 matrix 12-30% faster (docs/DECISIONS.md, "The int8-activation kernels").
constexpr int64_t kPrefetchRows = 4;        // weight rows ahead of the one being computed
constexpr int64_t kPrefetchScaleRows = 32;  // rows ahead in the scales, two cache lines of each group

constexpr float kRound = 12582912.f;  // 1.5 * 2^23

// Bytes of one weight row of K inputs. The int4 family's are nibbles, byte j holding inputs 2j (low) and 2j+1
// (high); int3/int2 come expanded to them. int6 keeps those nibbles as each code's low 4 bits (the row's first
// K/2 bytes, read as int4's are) and adds a plane of their top 2 bits (K/4 bytes): per 64 inputs 16 bytes, byte
// u holding, from bit 0, the tops of nibble byte u's low and high code, then those of nibble byte u + 16's.
// (Two planes rather than 48-byte chunks of 64 inputs: the nibbles load exactly as int4's do, with no load
// across a cache line; on a 150k-row head the two layouts measured the same, 22 GB/s.)
inline int64_t row_bytes(int bits, int64_t k) { return bits == 6 ? k / 2 + k / 4 : k / 2; }

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Rows of activations quantized for one weight format. In nibble order (for the int4 family's portable
// bytes, where byte j of a row holds inputs 2j, low nibble, and 2j+1, high) each 64 inputs are stored as
// their 32 even inputs, then their 32 odd ones: the low nibbles of 32 weight bytes then meet the first
// half and the high nibbles the second.
struct Activations {
  int64_t rows = 0, k = 0, group = 0;  // group: the weights' group size (int4 family), 0 for int8 weights
  std::vector<int8_t> q;               // [rows, K]
  std::vector<float> scale;            // int4: [rows, K/64, 8] (first block's d four times, second's four); int8: [rows, K/32]
  std::vector<float> sums;             // int4: [rows, K/G], the float activations summed over each group
  std::vector<float> centre;           // int4: [rows, K/G], sum_{b in g} d_b sum_{i in b} q_i (times C: the codes' -C)
};

// One block of 32 activations (float, or bf16 bits as uint16_t) -> its int8 codes in natural order, its
// scale d, the sum of its codes and the float sum of its inputs.
template <typename T>
inline void quantize_block_portable(const T* in, int8_t* q, float& d_out, int32_t& total, float& sum) {
  float v[kBlock];
  float amax = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    if constexpr (sizeof(T) == 2)
      v[i] = bf16_to_float(in[i]);
    else
      v[i] = static_cast<float>(in[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float d = amax / 127.f;
  const float inverse = d != 0.f ? 1.f / d : 0.f;
  total = 0, sum = 0.f;
  for (int64_t i = 0; i < kBlock; ++i) {
    // Round half to even (as nearbyint in the default rounding mode), without a libm call per input:
    // adding and subtracting 1.5 * 2^23 leaves the float rounded to an integer (|v / d| <= 127).
    q[i] = static_cast<int8_t>((v[i] * inverse + kRound) - kRound);
    total += q[i];
    sum += v[i];
  }
  d_out = d;
}

// A 64-input chunk's codes, natural order -> nibble order (its 32 even inputs, then its 32 odd ones).
inline void to_nibble_order_portable(const int8_t* natural, int8_t* out) {
  for (int64_t i = 0; i < kSuper; ++i) out[(i % 2) * kBlock + i / 2] = natural[i];
}

template <typename T>
void quantize_blocks(const T* x, int64_t rows, int64_t k, int64_t group, Activations& a,
                     void (*block)(const T*, int8_t*, float&, int32_t&, float&), void (*reorder)(const int8_t*, int8_t*)) {
  a.rows = rows, a.k = k, a.group = group;
  a.q.resize(rows * k);
  const int64_t blocks = k / kBlock, groups = group ? k / group : 0;
  a.scale.resize(group ? rows * (k / kSuper) * 8 : rows * blocks);
  a.sums.assign(rows * groups, 0.f);
  a.centre.assign(rows * groups, 0.f);
  alignas(32) int8_t natural[kSuper];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      float d, sum;
      int32_t total;
      if (!group) {
        block(x + r * k + b * kBlock, a.q.data() + r * k + b * kBlock, d, total, sum);
        a.scale[r * blocks + b] = d;
        continue;
      }
      block(x + r * k + b * kBlock, natural + (b % 2) * kBlock, d, total, sum);
      if (b % 2) reorder(natural, a.q.data() + r * k + (b / 2) * kSuper);  // a 64-input chunk: evens, then odds
      float* s = a.scale.data() + (r * (k / kSuper) + b / 2) * 8 + (b % 2) * 4;
      for (int t = 0; t < 4; ++t) s[t] = d;
      const int64_t g = b * kBlock / group;
      a.sums[r * groups + g] += sum;
      a.centre[r * groups + g] += d * static_cast<float>(total);
    }
  }
}

// ---- the portable loops (any CPU) ----------------------------------------------------------------------

// int4-family codes of `bits` bits (int3/int2 expanded to int4 bytes, int6 as `row_bytes` says), w [N, row_bytes]; scales and
// zeros bf16 [K/G, N, 2]; rows n0..n1 of y [rows, N]. With a `table` (16 int8 values), code c stands for T[c].
inline void int4_rows_portable(const Activations& a, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t n0, int64_t n1,
                               float* y, const int8_t* table = nullptr) {
  const float middle = static_cast<float>(1 << (bits - 1));
  const int64_t k = a.k, groups = k / a.group, supers = k / kSuper;
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t o = n0; o < n1; ++o) {
      const uint8_t* row = w + o * row_bytes(bits, k);
      float total = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = bf16_to_float(sz[(g * n + o) * 2]), z = bf16_to_float(sz[(g * n + o) * 2 + 1]);
        float in_group = 0.f;
        for (int64_t b = g * a.group / kBlock; b < (g + 1) * a.group / kBlock; ++b) {
          const int64_t j = b / 2, half = b % 2;  // the block's 64-input chunk, and which half of it
          const int8_t* q = a.q.data() + r * k + j * kSuper;
          int32_t dot = 0;
          for (int64_t t = half * 16; t < half * 16 + 16; ++t) {  // 16 bytes: 32 inputs of this block
            const uint8_t byte = row[j * 32 + t];
            int32_t even = table ? table[byte & 0x0F] : byte & 0x0F, odd = table ? table[byte >> 4] : byte >> 4;
            if (bits == 6) {  // the two codes' top bits
              const int top = row[k / 2 + j * 16 + t % 16] >> (t < 16 ? 0 : 4);
              even |= (top & 3) << 4, odd |= (top & 12) << 2;
            }
            dot += even * q[t] + odd * q[kBlock + t];
          }
          in_group += a.scale[(r * supers + j) * 8 + half * 4] * static_cast<float>(dot);
        }
        if (table)
          total += s * in_group + z * a.sums[r * groups + g];
        else
          total += s * in_group + ((z - (8.f - middle) * s) * a.sums[r * groups + g] - middle * s * a.centre[r * groups + g]);
      }
      y[r * n + o] = total;
    }
}

// int8 codes w [N, K], per-channel scales (float, or bf16 bits when `bf16_scales`); rows n0..n1 of y.
inline void int8_rows_portable(const Activations& a, const int8_t* w, const void* scales, bool bf16_scales, int64_t n, int64_t n0, int64_t n1,
                               float* y) {
  const int64_t k = a.k, blocks = k / kBlock;
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t o = n0; o < n1; ++o) {
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += static_cast<int32_t>(w[o * k + b * kBlock + i]) * a.q[r * k + b * kBlock + i];
        total += a.scale[r * blocks + b] * static_cast<float>(dot);
      }
      const float s = bf16_scales ? bf16_to_float(static_cast<const uint16_t*>(scales)[o]) : static_cast<const float*>(scales)[o];
      y[r * n + o] = s * total;
    }
}

}  // namespace lowbit

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace lowbit {
#define LOWBIT_AVX2 __attribute__((target("avx2,fma")))

// The order every SIMD loop takes: the activation rows in blocks of kRowBlock (a prefill's rows stay in L2
// while the weights stream past), in each weight rows n0..n1 in blocks of kWeightRows (they stay in cache for
// every activation row of the block), each against the block's rows in tiles of kRowTile, then the 1-3 left.
// tile(std::integral_constant<int64_t, K>{}, r0, b, e): K activation rows from r0 against weight rows b..e.
// (Every pair of rows is computed the same way whatever the order: the order changes no bits.)
constexpr int64_t kRowBlock = 128;
template <typename Tile>
inline void over_tiles(int64_t rows, int64_t n0, int64_t n1, Tile tile) {
  for (int64_t block = 0; block < rows; block += kRowBlock) {
    const int64_t end = std::min(block + kRowBlock, rows);
    for (int64_t b = n0; b < n1; b += kWeightRows) {
      const int64_t e = std::min(b + kWeightRows, n1);
      int64_t r0 = block;
      for (; r0 + kRowTile <= end; r0 += kRowTile) tile(std::integral_constant<int64_t, kRowTile>{}, r0, b, e);
      switch (end - r0) {
        case 3: tile(std::integral_constant<int64_t, 3>{}, r0, b, e); break;
        case 2: tile(std::integral_constant<int64_t, 2>{}, r0, b, e); break;
        case 1: tile(std::integral_constant<int64_t, 1>{}, r0, b, e); break;
      }
    }
  }
}

LOWBIT_AVX2 inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// As int4_rows_portable. Per 64 inputs: 32 weight bytes split into low and high nibbles (unsigned 0..15),
// maddubs against the even and odd activations (signed), summed into 16-bit pairs (at most 4 * 15 * 127,
// no saturation), madd into eight int32 (four per block), then scaled by d * s into a float accumulator.
// The codes' -C and the second term are applied once per group at the end (Activations::centre, sums).
// 64 inputs of one weight row (32 bytes) against kTile activation rows, their weight scale(s) in sv.
// int6 (kSix): the 16 bytes of top bits after the nibbles or'ed in as bits 4-5 (codes up to 63: a maddubs
// pair at most 2 * 63 * 127, the two pairs' sum 32,004, still no saturation).
template <int64_t kTile, bool kSix>
__attribute__((target("avx2,fma"), always_inline)) inline void int4_chunk(const uint8_t* row, const int8_t* q0, const float* d0, int64_t k,
                                                                         int64_t supers, int64_t j, __m256 sv, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * 32));
  __m256i lo = _mm256_and_si256(bytes, low);
  __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
  if constexpr (kSix) {
    const __m128i tops = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k / 2 + j * 16));
    const __m256i top = _mm256_set_m128i(_mm_srli_epi16(tops, 4), tops);  // lanes 16-31: nibble bytes 16-31's, bits 4-7
    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(0x03)), 4));
    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(0x0C)), 2));
  }
  for (int64_t t = 0; t < kTile; ++t) {
    const int8_t* q = q0 + t * k + j * kSuper;
    const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kBlock));
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
    const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
    const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(d0 + (t * supers + j) * 8), sv);
    acc[t] = _mm256_fmadd_ps(dots, ds, acc[t]);
  }
}

// As int4_chunk for a table format: the 64 codes looked up in the table (one shuffle per 32), then signed
// codes against signed activations as int8_tile_avx2 does. Each maddubs pair is at most 2 * 127 * 127, so
// the two halves are widened to int32 before they are added (16 bits would overflow).
template <int64_t kTile>
__attribute__((target("avx2,fma"), always_inline)) inline void table_chunk(const uint8_t* row, const int8_t* q0, const float* d0, int64_t k,
                                                                          int64_t supers, int64_t j, __m256 sv, __m256i table, __m256* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j * 32));
  const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(bytes, low));
  const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low));
  const __m256i lo_magnitude = _mm256_sign_epi8(lo, lo), hi_magnitude = _mm256_sign_epi8(hi, hi);
  for (int64_t t = 0; t < kTile; ++t) {
    const int8_t* q = q0 + t * k + j * kSuper;
    const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kBlock));
    const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo_magnitude, _mm256_sign_epi8(even, lo)), ones),
                                          _mm256_madd_epi16(_mm256_maddubs_epi16(hi_magnitude, _mm256_sign_epi8(odd, hi)), ones));
    const __m256 ds = _mm256_mul_ps(_mm256_loadu_ps(d0 + (t * supers + j) * 8), sv);
    acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), ds, acc[t]);
  }
}

// The part of 8 weight rows' dot products that is per group, not per input: their scales and zeros are one
// 32-byte load per group ([K/G, N, 2] keeps them side by side), so the zero's and the centre's terms are done
// for the 8 rows at once (into rest[t][i]), and the scales are kept as floats (scales[8 g + i]) for the
// main loop, whichever instructions it uses.
template <int64_t kTile>
__attribute__((target("avx2,fma"), always_inline)) inline void group_terms(const Activations& a, int64_t r0, const uint16_t* sz, int bits,
                                                                          int64_t n, int64_t o8, bool table, float* scales,
                                                                          float (*rest)[8]) {
  const int64_t groups = a.k / a.group;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 middle = _mm256_set1_ps(static_cast<float>(1 << (bits - 1)));
  const __m256 shift = _mm256_set1_ps(static_cast<float>(1 << (bits - 1)) - 8.f);
  __m256 terms[kTile];
  for (int64_t t = 0; t < kTile; ++t) terms[t] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + (g * n + o8) * 2));  // (s, z) of 8 rows
    _mm_prefetch(reinterpret_cast<const char*>(sz + (g * n + o8 + kPrefetchScaleRows) * 2), _MM_HINT_T0);
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
    const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(pairs, high_half));
    _mm256_storeu_ps(scales + g * 8, s);
    if (table) {  // W = T[c] s + z: the zero's term alone
      for (int64_t t = 0; t < kTile; ++t) terms[t] = _mm256_fmadd_ps(z, _mm256_broadcast_ss(a.sums.data() + (r0 + t) * groups + g), terms[t]);
      continue;
    }
    const __m256 offset = _mm256_fmadd_ps(s, shift, z);  // z - (8 - C) s
    const __m256 centred = _mm256_mul_ps(s, middle);     // C s
    for (int64_t t = 0; t < kTile; ++t) {
      terms[t] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(a.sums.data() + (r0 + t) * groups + g), terms[t]);
      terms[t] = _mm256_fnmadd_ps(centred, _mm256_broadcast_ss(a.centre.data() + (r0 + t) * groups + g), terms[t]);
    }
  }
  for (int64_t t = 0; t < kTile; ++t) _mm256_storeu_ps(rest[t], terms[t]);
}

// Weight rows n0..n1 (multiples of 8) against activation rows r0..r0+kTile.
template <int64_t kTile, bool kSix>  // activation rows per pass, a constant so that the accumulators stay in registers
LOWBIT_AVX2 inline void int4_tile_avx2(const Activations& a, int64_t r0, const uint8_t* w, const uint16_t* sz, int bits, int64_t n,
                                       int64_t n0, int64_t n1, float* scales, float* y, const int8_t* table) {
  const int64_t k = a.k, group = a.group, groups = k / group, supers = k / kSuper;
  const int8_t* q0 = a.q.data() + r0 * k;
  const float* d0 = a.scale.data() + r0 * supers * 8;
  const __m256i lookup = table ? _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))) : _mm256_setzero_si256();
  alignas(32) float rest[kTile][8];
  for (int64_t o8 = n0; o8 < n1; o8 += 8) {
    group_terms<kTile>(a, r0, sz, bits, n, o8, table != nullptr, scales, rest);
    for (int64_t i = 0; i < 8; ++i) {
      const float* s = scales + i;  // s[8 g]: this row's scale of group g
      __m256 acc[kTile];
      for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm256_setzero_ps();
      const int64_t stride = row_bytes(kSix ? 6 : 4, k);
      const uint8_t* row = w + (o8 + i) * stride;
      const char* ahead = reinterpret_cast<const char*>(row + kPrefetchRows * stride);
      for (int64_t at = 0; at < stride; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
      if (table) {  // table formats come in groups of 32 (quant.py)
        for (int64_t j = 0; j < supers; ++j)
          table_chunk<kTile>(row, q0, d0, k, supers, j, _mm256_set_m128(_mm_set1_ps(s[8 * (2 * j + 1)]), _mm_set1_ps(s[8 * 2 * j])), lookup, acc);
      } else if (group == kBlock) {  // two groups per 64 inputs
        for (int64_t j = 0; j < supers; ++j)
          int4_chunk<kTile, kSix>(row, q0, d0, k, supers, j, _mm256_set_m128(_mm_set1_ps(s[8 * (2 * j + 1)]), _mm_set1_ps(s[8 * 2 * j])), acc);
      } else {
        const int64_t per = group / kSuper;
        for (int64_t g = 0; g < groups; ++g) {
          const __m256 sv = _mm256_set1_ps(s[8 * g]);
          for (int64_t j = g * per; j < (g + 1) * per; ++j) int4_chunk<kTile, kSix>(row, q0, d0, k, supers, j, sv, acc);
        }
      }
      for (int64_t t = 0; t < kTile; ++t) y[(r0 + t) * n + o8 + i] = horizontal_sum(acc[t]) + rest[t][i];
    }
  }
}

// Weight rows n0..n1, multiples of 8 (kWeightRows at a time, for every activation row).
LOWBIT_AVX2 inline void int4_rows_avx2(const Activations& a, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t n0, int64_t n1,
                                       float* y, const int8_t* table) {
  std::vector<float> s(a.k / a.group * 8);  // 8 rows' scales per group, as float
  over_tiles(a.rows, n0, n1, [&](auto tile, int64_t r0, int64_t b, int64_t e) {
    if (bits == 6)
      int4_tile_avx2<decltype(tile)::value, true>(a, r0, w, sz, bits, n, b, e, s.data(), y, table);
    else
      int4_tile_avx2<decltype(tile)::value, false>(a, r0, w, sz, bits, n, b, e, s.data(), y, table);
  });
}

// As int8_rows_portable. Signed codes against signed activations: maddubs takes |c| (unsigned; -128 reads
// as 128) and q with c's sign (the products at most 2 * 128 * 127 per pair, no saturation).
template <int64_t kTile>
LOWBIT_AVX2 inline void int8_tile_avx2(const Activations& a, int64_t r0, const int8_t* w, const void* scales, bool bf16_scales, int64_t n,
                                       int64_t n0, int64_t n1, float* y) {
  const int64_t k = a.k, blocks = k / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* q0 = a.q.data() + r0 * k;
  const float* d0 = a.scale.data() + r0 * blocks;
  for (int64_t o = n0; o < n1; ++o) {
    __m256 acc[kTile];
    for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm256_setzero_ps();
    const int8_t* row = w + o * k;
    const char* ahead = reinterpret_cast<const char*>(row + kPrefetchRows * k);
    for (int64_t at = 0; at < k; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
    for (int64_t b = 0; b < blocks; ++b) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
      const __m256i magnitude = _mm256_sign_epi8(codes, codes);
      for (int64_t t = 0; t < kTile; ++t) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q0 + t * k + b * kBlock));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, codes));
        const __m256 dots = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
        acc[t] = _mm256_fmadd_ps(dots, _mm256_broadcast_ss(d0 + t * blocks + b), acc[t]);
      }
    }
    const float s = bf16_scales ? bf16_to_float(static_cast<const uint16_t*>(scales)[o]) : static_cast<const float*>(scales)[o];
    for (int64_t t = 0; t < kTile; ++t) y[(r0 + t) * n + o] = s * horizontal_sum(acc[t]);
  }
}

LOWBIT_AVX2 inline void int8_rows_avx2(const Activations& a, const int8_t* w, const void* scales, bool bf16_scales, int64_t n, int64_t n0,
                                       int64_t n1, float* y) {
  over_tiles(a.rows, n0, n1, [&](auto tile, int64_t r0, int64_t b, int64_t e) {
    int8_tile_avx2<decltype(tile)::value>(a, r0, w, scales, bf16_scales, n, b, e, y);
  });
}

// As quantize_block_portable, eight inputs per instruction (the same codes, scale and code sum; the float
// sum is added in another order).
template <typename T>
LOWBIT_AVX2 inline void quantize_block_avx2(const T* in, int8_t* q, float& d_out, int32_t& total, float& sum) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
    if constexpr (sizeof(T) == 2)
      v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 8 * i))), 16));
    else
      v[i] = _mm256_loadu_ps(in + 8 * i);
  }
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float d = _mm_cvtss_f32(h) / 127.f;
  const __m256 inverse = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
  __m256i c[4];
  for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // round half to even
  __m256i t = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  total = _mm_cvtsi128_si32(t4);
  sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  // packs works per 128-bit lane: the bytes come out as (c0 0-3, c1 0-3, c2 0-3, c3 0-3 | c0 4-7, ...)
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  d_out = d;
}

// As to_nibble_order_portable: evens and odds split within each 16 bytes, then the halves gathered.
LOWBIT_AVX2 inline void to_nibble_order_avx2(const int8_t* natural, int8_t* out) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9,
                                         11, 13, 15);
  // each: (evens of its first 16 | evens of its second 16 | odds of its first 16 | odds of its second 16)
  const __m256i first = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(natural)), split), 0xD8);
  const __m256i second =
      _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(natural + 32)), split), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(first, second, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), _mm256_permute2x128_si256(first, second, 0x31));
}

inline bool has_avx2() { return cpu::features().avx2_fma; }

// ---- AVX-512 with VNNI (Intel Ice Lake and later, AMD Zen 4 and later) ------------------------------------
// The same integer dot products as the AVX2 loops, each 4-byte group summed by one vpdpbusd (u8 x s8 -> s32)
// where AVX2 needs maddubs, an add and madd, over 64 bytes per instruction: two 64-input chunks of a weight
// row at once. Each int32 lane sums the same four products as the AVX2 loop's lane, so the integer sums are
// the same; the float sums over blocks run over 16 lanes instead of 8 (another order of the same terms).
#define LOWBIT_VNNI __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

inline bool has_avx512_vnni() { return cpu::features().avx512_vnni; }

// Two 256-bit halves as one 512-bit vector (lo in the low half).
#define LOWBIT_JOIN(lo, hi) _mm512_inserti64x4(_mm512_castsi256_si512(lo), (hi), 1)
#define LOWBIT_LOAD256(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))

// As int4_chunk, for chunks j and j + 1 of one weight row (64 bytes); sv: their weight scales per lane.
template <int64_t kTile, bool kSix>
__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"), always_inline)) inline void int4_pair_vnni(
    const uint8_t* row, const int8_t* q0, const float* d0, int64_t k, int64_t supers, int64_t j, __m512 sv, const __m512i* table,
    __m512* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i bytes = _mm512_loadu_si512(row + j * 32);
  __m512i lo = _mm512_and_si512(bytes, low);
  __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  if constexpr (kSix) {  // each chunk's tops as int4_chunk places them: 128-bit lanes (t0, t0 >> 4, t1, t1 >> 4)
    const __m256i tops = LOWBIT_LOAD256(row + k / 2 + j * 16);
    const __m512i both = LOWBIT_JOIN(tops, _mm256_srli_epi16(tops, 4));  // lanes (t0, t1, t0 >> 4, t1 >> 4)
    const __m512i top = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi8(0x03)), 4));
    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi8(0x0C)), 2));
  }
  __m512i lo_sign = lo, hi_sign = hi;
  if (table) {  // signed table values: |T[c]| against q with T[c]'s sign, as table_chunk
    lo_sign = _mm512_shuffle_epi8(*table, lo), hi_sign = _mm512_shuffle_epi8(*table, hi);
    lo = _mm512_abs_epi8(lo_sign), hi = _mm512_abs_epi8(hi_sign);
  }
  for (int64_t t = 0; t < kTile; ++t) {
    const int8_t* q = q0 + t * k + j * kSuper;
    __m512i even = LOWBIT_JOIN(LOWBIT_LOAD256(q), LOWBIT_LOAD256(q + kSuper));
    __m512i odd = LOWBIT_JOIN(LOWBIT_LOAD256(q + kBlock), LOWBIT_LOAD256(q + kSuper + kBlock));
    if (table) {  // q * sign(T[c]) (0 where T[c] is 0), as _mm256_sign_epi8 does
      const __m512i zero = _mm512_setzero_si512();
      even = _mm512_mask_sub_epi8(_mm512_maskz_mov_epi8(_mm512_cmpneq_epi8_mask(lo_sign, zero), even),
                                  _mm512_cmplt_epi8_mask(lo_sign, zero), zero, even);
      odd = _mm512_mask_sub_epi8(_mm512_maskz_mov_epi8(_mm512_cmpneq_epi8_mask(hi_sign, zero), odd), _mm512_cmplt_epi8_mask(hi_sign, zero),
                                 zero, odd);
    }
    const __m512i dots = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, even), hi, odd);
    const __m512 ds = _mm512_mul_ps(_mm512_loadu_ps(d0 + (t * supers + j) * 8), sv);
    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), ds, acc[t]);
  }
}

// As int4_tile_avx2, two chunks per step (`supers` even: K a multiple of 128).
template <int64_t kTile, bool kSix>
LOWBIT_VNNI inline void int4_tile_vnni(const Activations& a, int64_t r0, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t n0,
                                       int64_t n1, float* scales, float* y, const int8_t* table) {
  const int64_t k = a.k, group = a.group, supers = k / kSuper;
  const int8_t* q0 = a.q.data() + r0 * k;
  const float* d0 = a.scale.data() + r0 * supers * 8;
  const __m512i lookup = table ? _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))) : _mm512_setzero_si512();
  alignas(32) float rest[kTile][8];
  for (int64_t o8 = n0; o8 < n1; o8 += 8) {
    group_terms<kTile>(a, r0, sz, bits, n, o8, table != nullptr, scales, rest);
    for (int64_t i = 0; i < 8; ++i) {
      const float* s = scales + i;  // s[8 g]: this row's scale of group g
      __m512 acc[kTile];
      for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
      const int64_t stride = row_bytes(kSix ? 6 : 4, k);
      const uint8_t* row = w + (o8 + i) * stride;
      const char* ahead = reinterpret_cast<const char*>(row + kPrefetchRows * stride);
      for (int64_t at = 0; at < stride; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
      // The scale of each lane's group: 4 lanes a group at 32, 8 at 64, all 16 from 128 on. scales keeps
      // the 8 rows' scales of a group side by side, so this row's are 8 floats apart: one permute picks them.
      const __m512i every_fourth = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
      const __m512i every_eighth = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
      for (int64_t j = 0; j < supers; j += 2) {
        __m512 sv;
        if (group == kBlock)
          sv = _mm512_permutex2var_ps(_mm512_loadu_ps(s + 16 * j), every_fourth, _mm512_loadu_ps(s + 16 * j + 16));
        else if (group == kSuper)
          sv = _mm512_permutexvar_ps(every_eighth, _mm512_loadu_ps(s + 8 * j));
        else
          sv = _mm512_set1_ps(s[8 * (j * kSuper / group)]);
        int4_pair_vnni<kTile, kSix>(row, q0, d0, k, supers, j, sv, table ? &lookup : nullptr, acc);
      }
      for (int64_t t = 0; t < kTile; ++t) y[(r0 + t) * n + o8 + i] = _mm512_reduce_add_ps(acc[t]) + rest[t][i];
    }
  }
}

LOWBIT_VNNI inline void int4_rows_vnni(const Activations& a, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t n0, int64_t n1,
                                       float* y, const int8_t* table) {
  std::vector<float> s(a.k / a.group * 8);
  over_tiles(a.rows, n0, n1, [&](auto tile, int64_t r0, int64_t b, int64_t e) {
    if (bits == 6)
      int4_tile_vnni<decltype(tile)::value, true>(a, r0, w, sz, bits, n, b, e, s.data(), y, table);
    else
      int4_tile_vnni<decltype(tile)::value, false>(a, r0, w, sz, bits, n, b, e, s.data(), y, table);
  });
}

// As int8_tile_avx2, two blocks (64 bytes) per step (K a multiple of 64): |c| against q with c's sign.
template <int64_t kTile>
LOWBIT_VNNI inline void int8_tile_vnni(const Activations& a, int64_t r0, const int8_t* w, const void* scales, bool bf16_scales, int64_t n,
                                       int64_t n0, int64_t n1, float* y) {
  const int64_t k = a.k, blocks = k / kBlock;
  const int8_t* q0 = a.q.data() + r0 * k;
  const float* d0 = a.scale.data() + r0 * blocks;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t o = n0; o < n1; ++o) {
    __m512 acc[kTile];
    for (int64_t t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
    const int8_t* row = w + o * k;
    const char* ahead = reinterpret_cast<const char*>(row + kPrefetchRows * k);
    for (int64_t at = 0; at < k; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T0);
    for (int64_t b = 0; b < blocks; b += 2) {
      const __m512i codes = _mm512_loadu_si512(row + b * kBlock);
      const __m512i magnitude = _mm512_abs_epi8(codes);
      const __mmask64 nonzero = _mm512_cmpneq_epi8_mask(codes, zero), negative = _mm512_cmplt_epi8_mask(codes, zero);
      for (int64_t t = 0; t < kTile; ++t) {
        const __m512i q = _mm512_loadu_si512(q0 + t * k + b * kBlock);
        const __m512i signed_q = _mm512_mask_sub_epi8(_mm512_maskz_mov_epi8(nonzero, q), negative, zero, q);
        const __m512i dots = _mm512_dpbusd_epi32(zero, magnitude, signed_q);
        const __m512 ds = _mm512_insertf32x8(_mm512_set1_ps(d0[t * blocks + b]), _mm256_set1_ps(d0[t * blocks + b + 1]), 1);
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), ds, acc[t]);
      }
    }
    const float s = bf16_scales ? bf16_to_float(static_cast<const uint16_t*>(scales)[o]) : static_cast<const float*>(scales)[o];
    for (int64_t t = 0; t < kTile; ++t) y[(r0 + t) * n + o] = s * _mm512_reduce_add_ps(acc[t]);
  }
}

LOWBIT_VNNI inline void int8_rows_vnni(const Activations& a, const int8_t* w, const void* scales, bool bf16_scales, int64_t n, int64_t n0,
                                       int64_t n1, float* y) {
  over_tiles(a.rows, n0, n1, [&](auto tile, int64_t r0, int64_t b, int64_t e) {
    int8_tile_vnni<decltype(tile)::value>(a, r0, w, scales, bf16_scales, n, b, e, y);
  });
}
}  // namespace lowbit
#else
namespace lowbit {
inline bool has_avx2() { return false; }
inline bool has_avx512_vnni() { return false; }
}  // namespace lowbit
#endif

namespace lowbit {
// The variants of the loops, from the plainest: each CPU runs the most capable one it has (`isa()`).
enum class Isa { portable = 0, avx2 = 1, avx512_vnni = 2 };

// The most capable variant allowed (the tests lower it to compare each variant with the portable loops).
inline Isa& isa_cap() {
  static Isa cap = Isa::avx512_vnni;
  return cap;
}

// The variant this CPU runs: chosen once from what it reports, then capped.
inline Isa isa() {
  static const Isa best = has_avx512_vnni() ? Isa::avx512_vnni : has_avx2() ? Isa::avx2 : Isa::portable;
  return std::min(best, isa_cap());
}

// The variant a matrix's loops run: the CPU's (`isa()`) where its loop takes the matrix's shape, else the
// next plainer one. The dispatch below and the load-time plan (`lowbit_variant`, core/compute/plan.py) both
// ask these, so what the plan reports is what runs.
inline Isa int4_variant(int64_t group, int64_t k) {
#if defined(__x86_64__) && defined(__GNUC__)
  // (group 32 stays on AVX2: its two scales per chunk cost the VNNI loop what its dot products save;
  // benchmarks/isa_variants.py measured 0.91-1.05x there, 1.05-1.26x at group 64)
  if (isa() == Isa::avx512_vnni && group != kBlock && (k / kSuper) % 2 == 0) return Isa::avx512_vnni;
  if (isa() >= Isa::avx2) return Isa::avx2;
#endif
  return Isa::portable;
}

inline Isa int8_variant(int64_t k) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa() == Isa::avx512_vnni && (k / kBlock) % 2 == 0) return Isa::avx512_vnni;
  if (isa() >= Isa::avx2) return Isa::avx2;
#endif
  return Isa::portable;
}

// The dispatch: each matrix's variant, else the portable loops.
inline void int4_rows(const Activations& a, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t n0, int64_t n1, float* y,
                      const int8_t* table = nullptr) {
#if defined(__x86_64__) && defined(__GNUC__)
  const Isa variant = int4_variant(a.group, a.k);
  if (variant == Isa::avx512_vnni) return int4_rows_vnni(a, w, sz, bits, n, n0, n1, y, table);
  if (variant == Isa::avx2) return int4_rows_avx2(a, w, sz, bits, n, n0, n1, y, table);
#endif
  int4_rows_portable(a, w, sz, bits, n, n0, n1, y, table);
}

// x [rows, K] (float, or bf16 bits as uint16_t) -> a, in nibble order for the int4 family (`group` its
// group size) or natural order for int8 weights (`group` 0).
template <typename T>
void quantize(const T* x, int64_t rows, int64_t k, int64_t group, Activations& a) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa() >= Isa::avx2) return quantize_blocks<T>(x, rows, k, group, a, quantize_block_avx2<T>, to_nibble_order_avx2);
#endif
  quantize_blocks<T>(x, rows, k, group, a, quantize_block_portable<T>, to_nibble_order_portable);
}

inline void int8_rows(const Activations& a, const int8_t* w, const void* scales, bool bf16_scales, int64_t n, int64_t n0, int64_t n1, float* y) {
#if defined(__x86_64__) && defined(__GNUC__)
  const Isa variant = int8_variant(a.k);
  if (variant == Isa::avx512_vnni) return int8_rows_vnni(a, w, scales, bf16_scales, n, n0, n1, y);
  if (variant == Isa::avx2) return int8_rows_avx2(a, w, scales, bf16_scales, n, n0, n1, y);
#endif
  int8_rows_portable(a, w, scales, bf16_scales, n, n0, n1, y);
}
}  // namespace lowbit
