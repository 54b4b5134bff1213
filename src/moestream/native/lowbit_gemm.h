// The int8-activation matmuls of lowbit_dot.h for many activation rows at once (a prompt's tokens, the
// tokens routed to one expert in a prefill): the same arithmetic, lane for lane, in loops blocked for the
// registers and the caches instead of one weight row at a time.
//
// lowbit_dot.h's loops were built for decode: each weight row is unpacked once and met by at most four
// activation rows, whose codes are reassembled from two 256-bit halves for every weight row again. Here a
// tile of kGemmWeightRows weight rows x up to kRowTile activation rows keeps one accumulator per pair in
// registers: each weight row's codes are unpacked once per tile, each activation load feeds every weight row
// of the tile (and is read as the instruction's memory operand, in a layout made for it once per call), and
// the activations are taken in blocks of kRowBlock rows that stay in L2 while the weight rows stream by
// (as lowbit_dot.h's loops now take them too).
//
// Same numbers: every (activation row, weight row) pair runs exactly the instructions the decode loop runs
// for it (the same integer dot products per lane, the same float multiply and fused add per step, the same
// reduction at the end), so a token gets the same bits in a prefill as alone (tests/test_int8_activations.py).
// What differs is only which pairs are computed when.
//
// int8 weights: VNNI multiplies unsigned by signed bytes. The decode loop moves the weights' signs onto the
// activations in every step; here the weights are read as c + 128 (unsigned) and the sum is started at
// -128 times the activations' sum per lane, computed once per call: the same exact integer.
#pragma once

namespace lowbit {
// Activation rows from which a matmul takes these loops (the tests and benchmarks move it to compare both).
inline int64_t& gemm_rows() {
  static int64_t rows = 16;
  return rows;
}
}  // namespace lowbit

#if defined(__x86_64__) && defined(__GNUC__)
namespace lowbit {

constexpr int64_t kGemmWeightRows = 4;   // weight rows per register tile (4 x kRowTile accumulators)

// The activations of an int4-family matrix for the VNNI tile: per row, each pair of 64-input chunks (j, j+1)
// as [evens j | evens j+1 | odds j | odds j+1], so that one 512-bit load gives what LOWBIT_JOIN assembles.
LOWBIT_VNNI inline void pair_chunks(const Activations& a, std::vector<int8_t>& out) {
  out.resize(a.rows * a.k);
  for (int64_t r = 0; r < a.rows; ++r)
    for (int64_t at = 0; at < a.k; at += 2 * kSuper) {
      const int8_t* in = a.q.data() + r * a.k + at;
      int8_t* o = out.data() + r * a.k + at;
      std::memcpy(o, in, kBlock);                          // evens of chunk j
      std::memcpy(o + kBlock, in + kSuper, kBlock);        // evens of chunk j + 1
      std::memcpy(o + 2 * kBlock, in + kBlock, kBlock);    // odds of chunk j
      std::memcpy(o + 3 * kBlock, in + kSuper + kBlock, kBlock);  // odds of chunk j + 1
    }
}

// kRows weight rows (from `row`, `stride` bytes apart) against kTile activation rows from r0: the decode
// loop's int4_pair_vnni per pair. `sv`: per weight row, its scales per lane for each chunk pair.
template <int64_t kRows, int64_t kTile, bool kSix>
LOWBIT_VNNI inline void int4_tile_gemm_vnni(const Activations& a, const int8_t* pairs, int64_t r0, const uint8_t* row, int64_t stride,
                                            const float* sv, int64_t pairs_per_row, float (*rest)[8], int64_t i0, float* y, int64_t n,
                                            int64_t o) {
  const int64_t k = a.k, supers = k / kSuper;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[kRows][kTile];
  for (int64_t u = 0; u < kRows; ++u)
    for (int64_t t = 0; t < kTile; ++t) acc[u][t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < supers; j += 2) {
    __m512i lo[kRows], hi[kRows];
    for (int64_t u = 0; u < kRows; ++u) {
      const uint8_t* w = row + u * stride;
      const __m512i bytes = _mm512_loadu_si512(w + j * 32);
      lo[u] = _mm512_and_si512(bytes, low);
      hi[u] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
      if constexpr (kSix) {
        const __m256i tops = LOWBIT_LOAD256(w + k / 2 + j * 16);
        const __m512i both = LOWBIT_JOIN(tops, _mm256_srli_epi16(tops, 4));
        const __m512i top = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));
        lo[u] = _mm512_or_si512(lo[u], _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi8(0x03)), 4));
        hi[u] = _mm512_or_si512(hi[u], _mm512_slli_epi16(_mm512_and_si512(top, _mm512_set1_epi8(0x0C)), 2));
      }
    }
    for (int64_t t = 0; t < kTile; ++t) {
      const int8_t* q = pairs + (r0 + t) * k + j * kSuper;
      const __m512i even = _mm512_loadu_si512(q), odd = _mm512_loadu_si512(q + 2 * kBlock);
      const __m512 d = _mm512_loadu_ps(a.scale.data() + ((r0 + t) * supers + j) * 8);
      for (int64_t u = 0; u < kRows; ++u) {
        const __m512i dots = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[u], even), hi[u], odd);
        const __m512 ds = _mm512_mul_ps(d, _mm512_loadu_ps(sv + (u * pairs_per_row + j / 2) * 16));
        acc[u][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), ds, acc[u][t]);
      }
    }
  }
  for (int64_t u = 0; u < kRows; ++u)
    for (int64_t t = 0; t < kTile; ++t) y[(r0 + t) * n + o + u] = _mm512_reduce_add_ps(acc[u][t]) + rest[t][i0 + u];
}

// kTile activation rows from r0 against weight rows o8..o8+8: the group terms as int4_tile_vnni has them, then
// two register tiles. With `fill`, `sv` is made from the 8 rows' scales first (a block's first tile).
template <int64_t kTile, bool kSix>
LOWBIT_VNNI inline void int4_rows_gemm_vnni(const Activations& a, const int8_t* pairs, int64_t r0, const uint8_t* w, const uint16_t* sz, int bits,
                                            int64_t n, int64_t o8, float* scales, float* sv, bool fill, float* y) {
  const int64_t k = a.k, group = a.group, supers = k / kSuper, per_row = supers / 2;
  const int64_t stride = row_bytes(kSix ? 6 : 4, k);
  alignas(64) float rest[kTile][8];
  group_terms<kTile>(a, r0, sz, bits, n, o8, false, scales, rest);
  if (fill) {  // each lane's weight scale, as int4_tile_vnni picks it (groups of 64, or one group a chunk pair)
    const __m512i every_eighth = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t j = 0; j < supers; j += 2) {
        const float* s = scales + i;
        _mm512_storeu_ps(sv + (i * per_row + j / 2) * 16, group == kSuper ? _mm512_permutexvar_ps(every_eighth, _mm512_loadu_ps(s + 8 * j))
                                                                          : _mm512_set1_ps(s[8 * (j * kSuper / group)]));
      }
  }
  for (int64_t i0 = 0; i0 < 8; i0 += kGemmWeightRows)
    int4_tile_gemm_vnni<kGemmWeightRows, kTile, kSix>(a, pairs, r0, w + (o8 + i0) * stride, stride, sv + i0 * per_row * 16, per_row, rest, i0, y, n,
                                                      o8 + i0);
}

// Weight rows n0..n1 (multiples of 8) of an int4-family matrix (not a table format; groups of 64 and more)
// against every activation row, as int4_rows_vnni computes them, in over_tiles' order.
template <bool kSix>
LOWBIT_VNNI inline void int4_gemm_vnni(const Activations& a, const int8_t* pairs, const uint8_t* w, const uint16_t* sz, int bits, int64_t n,
                                       int64_t n0, int64_t n1, float* y) {
  const int64_t per_row = a.k / kSuper / 2;
  std::vector<float> scales(a.k / a.group * 8);
  std::vector<float> sv(kWeightRows * per_row * 16);  // per row of a weight block, per chunk pair: its 16 lanes' weight scales
  over_tiles(a.rows, n0, n1, [&](auto tile, int64_t r0, int64_t b, int64_t e) {
    const bool fill = r0 % kRowBlock == 0;  // a block's first tile against these weight rows
    for (int64_t o8 = b; o8 < e; o8 += 8)
      int4_rows_gemm_vnni<decltype(tile)::value, kSix>(a, pairs, r0, w, sz, bits, n, o8, scales.data(), sv.data() + (o8 - b) * per_row * 16, fill, y);
  });
}

// ---- the AVX2 loops' arithmetic (int4_tile_avx2): 8 lanes a 64-input chunk, the int4 family's groups of 32 too --
// A lane of int4_chunk sums the four products of one 4-byte group (maddubs, add, madd: no saturation for codes
// up to 15, or 63 for int6); VNNI's 256-bit vpdpbusd sums the same four. So the same tile runs with either:
// with VNNI (its 32 vector registers: 4 weight rows a tile) where a matrix's variant is AVX2 on a VNNI CPU
// (groups of 32, or K an odd number of 64-input chunks), else with AVX2's own instructions (16 registers: 2
// weight rows a tile). Either way each pair gets int4_tile_avx2's bits.
template <int64_t kRows, int64_t kTile, bool kSix>
__attribute__((target("avx2,fma"), always_inline)) inline void int4_tile_256_body(const Activations& a, int64_t r0, const uint8_t* row,
                                                                                 int64_t stride, const float* scales, float (*rest)[8], int64_t i0,
                                                                                 float* y, int64_t n, int64_t o, bool vnni_dots) {
  const int64_t k = a.k, group = a.group, supers = k / kSuper;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* q0 = a.q.data() + r0 * k;
  const float* d0 = a.scale.data() + r0 * supers * 8;
  __m256 acc[kRows][kTile];
  for (int64_t u = 0; u < kRows; ++u)
    for (int64_t t = 0; t < kTile; ++t) acc[u][t] = _mm256_setzero_ps();
  for (int64_t j = 0; j < supers; ++j) {
    __m256i lo[kRows], hi[kRows];
    __m256 sv[kRows];
    for (int64_t u = 0; u < kRows; ++u) {
      const uint8_t* w = row + u * stride;
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * 32));
      lo[u] = _mm256_and_si256(bytes, low);
      hi[u] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
      if constexpr (kSix) {
        const __m128i tops = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2 + j * 16));
        const __m256i top = _mm256_set_m128i(_mm_srli_epi16(tops, 4), tops);
        lo[u] = _mm256_or_si256(lo[u], _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(0x03)), 4));
        hi[u] = _mm256_or_si256(hi[u], _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(0x0C)), 2));
      }
      const float* s = scales + i0 + u;  // s[8 g]: this row's scale of group g
      sv[u] = group == kBlock ? _mm256_set_m128(_mm_set1_ps(s[8 * (2 * j + 1)]), _mm_set1_ps(s[8 * 2 * j]))
                              : _mm256_set1_ps(s[8 * (j * kSuper / group)]);
    }
    for (int64_t t = 0; t < kTile; ++t) {
      const int8_t* q = q0 + t * k + j * kSuper;
      const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + kBlock));
      const __m256 d = _mm256_loadu_ps(d0 + (t * supers + j) * 8);
      for (int64_t u = 0; u < kRows; ++u) {
        __m256i dots;
        if (vnni_dots)
          dots = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[u], even), hi[u], odd);
        else
          dots = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[u], even), _mm256_maddubs_epi16(hi[u], odd)), ones);
        acc[u][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_mul_ps(d, sv[u]), acc[u][t]);
      }
    }
  }
  for (int64_t u = 0; u < kRows; ++u)
    for (int64_t t = 0; t < kTile; ++t) y[(r0 + t) * n + o + u] = horizontal_sum(acc[u][t]) + rest[t][i0 + u];
}

template <int64_t kRows, int64_t kTile, bool kSix>
LOWBIT_VNNI inline void int4_tile_256_vnni(const Activations& a, int64_t r0, const uint8_t* row, int64_t stride, const float* scales,
                                           float (*rest)[8], int64_t i0, float* y, int64_t n, int64_t o) {
  int4_tile_256_body<kRows, kTile, kSix>(a, r0, row, stride, scales, rest, i0, y, n, o, true);
}

template <int64_t kRows, int64_t kTile, bool kSix>
LOWBIT_AVX2 inline void int4_tile_256_avx2(const Activations& a, int64_t r0, const uint8_t* row, int64_t stride, const float* scales,
                                           float (*rest)[8], int64_t i0, float* y, int64_t n, int64_t o) {
  int4_tile_256_body<kRows, kTile, kSix>(a, r0, row, stride, scales, rest, i0, y, n, o, false);
}

// kTile activation rows from r0 against weight rows o8..o8+8 in the AVX2 loops' arithmetic.
template <int64_t kTile, bool kSix, bool kVnni>
LOWBIT_AVX2 inline void int4_rows_gemm_256(const Activations& a, int64_t r0, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t o8,
                                           float* scales, float* y) {
  const int64_t stride = row_bytes(kSix ? 6 : 4, a.k);
  alignas(32) float rest[kTile][8];
  group_terms<kTile>(a, r0, sz, bits, n, o8, false, scales, rest);
  constexpr int64_t kRows = kVnni ? 4 : 2;
  for (int64_t i0 = 0; i0 < 8; i0 += kRows) {
    if constexpr (kVnni)
      int4_tile_256_vnni<kRows, kTile, kSix>(a, r0, w + (o8 + i0) * stride, stride, scales, rest, i0, y, n, o8 + i0);
    else
      int4_tile_256_avx2<kRows, kTile, kSix>(a, r0, w + (o8 + i0) * stride, stride, scales, rest, i0, y, n, o8 + i0);
  }
}

template <bool kSix, bool kVnni>
LOWBIT_AVX2 inline void int4_gemm_256(const Activations& a, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t n0, int64_t n1,
                                      float* y) {
  std::vector<float> scales(a.k / a.group * 8);
  over_tiles(a.rows, n0, n1, [&](auto tile, int64_t r0, int64_t b, int64_t e) {
    for (int64_t o8 = b; o8 < e; o8 += 8) int4_rows_gemm_256<decltype(tile)::value, kSix, kVnni>(a, r0, w, sz, bits, n, o8, scales.data(), y);
  });
}

// -128 times each lane's four activation codes, per row: where the int8 tile starts its sums.
LOWBIT_VNNI inline void lane_corrections(const Activations& a, std::vector<int32_t>& out) {
  out.resize(a.rows * a.k / 4);
  const int8_t* q = a.q.data();
  for (int64_t i = 0; i < a.rows * a.k / 4; ++i) out[i] = -128 * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
}

// kRows int8 weight rows from `o` against kTile activation rows from r0: int8_tile_vnni's sums per pair.
template <int64_t kRows, int64_t kTile>
LOWBIT_VNNI inline void int8_tile_gemm_vnni(const Activations& a, const int32_t* corrections, int64_t r0, const int8_t* w, const void* scales,
                                            bool bf16_scales, float* y, int64_t n, int64_t o) {
  const int64_t k = a.k, blocks = k / kBlock;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[kRows][kTile];
  for (int64_t u = 0; u < kRows; ++u)
    for (int64_t t = 0; t < kTile; ++t) acc[u][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += 2) {
    __m512i codes[kRows];  // c + 128, unsigned
    for (int64_t u = 0; u < kRows; ++u) codes[u] = _mm512_xor_si512(_mm512_loadu_si512(w + (o + u) * k + b * kBlock), flip);
    for (int64_t t = 0; t < kTile; ++t) {
      const int64_t at = (r0 + t) * k + b * kBlock;
      const __m512i q = _mm512_loadu_si512(a.q.data() + at);
      const __m512i start = _mm512_loadu_si512(corrections + at / 4);
      const float* d = a.scale.data() + (r0 + t) * blocks + b;
      const __m512 ds = _mm512_insertf32x8(_mm512_set1_ps(d[0]), _mm256_set1_ps(d[1]), 1);
      for (int64_t u = 0; u < kRows; ++u)
        acc[u][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, codes[u], q)), ds, acc[u][t]);
    }
  }
  for (int64_t u = 0; u < kRows; ++u) {
    const float s = bf16_scales ? bf16_to_float(static_cast<const uint16_t*>(scales)[o + u]) : static_cast<const float*>(scales)[o + u];
    for (int64_t t = 0; t < kTile; ++t) y[(r0 + t) * n + o + u] = s * _mm512_reduce_add_ps(acc[u][t]);
  }
}

// Weight rows n0..n1 of an int8 matrix against every activation row, as int8_rows_vnni computes them, in
// over_tiles' order (each weight block in register tiles of kGemmWeightRows, then one row at a time).
LOWBIT_VNNI inline void int8_gemm_vnni(const Activations& a, const int32_t* corrections, const int8_t* w, const void* scales, bool bf16_scales,
                                       int64_t n, int64_t n0, int64_t n1, float* y) {
  over_tiles(a.rows, n0, n1, [&](auto tile, int64_t r0, int64_t b, int64_t e) {
    constexpr int64_t kTile = decltype(tile)::value;
    int64_t o = b;
    for (; o + kGemmWeightRows <= e; o += kGemmWeightRows)
      int8_tile_gemm_vnni<kGemmWeightRows, kTile>(a, corrections, r0, w, scales, bf16_scales, y, n, o);
    for (; o < e; ++o) int8_tile_gemm_vnni<1, kTile>(a, corrections, r0, w, scales, bf16_scales, y, n, o);
  });
}

// Whether a matmul takes the blocked loops: gemm_rows() activation rows or more, not a table format, and a
// SIMD variant for its matrix (the int4 family: VNNI or the AVX2 loops' arithmetic; int8: VNNI). Then `prepare` makes, once per call and before the rows are split across threads, the
// activations' layout the loops read (`GemmInputs`), and `int4_gemm` / `int8_gemm` compute rows n0..n1.
struct GemmInputs {
  std::vector<int8_t> pairs;         // int4 family: pair_chunks
  std::vector<int32_t> corrections;  // int8: lane_corrections
};

inline bool int4_gemm_applies(const Activations& a, const int8_t* table) {
  return a.rows >= gemm_rows() && table == nullptr && int4_variant(a.group, a.k) >= Isa::avx2;
}

inline bool int8_gemm_applies(const Activations& a) { return a.rows >= gemm_rows() && int8_variant(a.k) == Isa::avx512_vnni; }

inline void prepare_int4(const Activations& a, GemmInputs& in) {
  if (int4_variant(a.group, a.k) == Isa::avx512_vnni) pair_chunks(a, in.pairs);
}
inline void prepare_int8(const Activations& a, GemmInputs& in) { lane_corrections(a, in.corrections); }

inline void int4_gemm(const Activations& a, const GemmInputs& in, const uint8_t* w, const uint16_t* sz, int bits, int64_t n, int64_t n0, int64_t n1,
                      float* y) {
  const bool six = bits == 6;
  if (int4_variant(a.group, a.k) == Isa::avx512_vnni)
    six ? int4_gemm_vnni<true>(a, in.pairs.data(), w, sz, bits, n, n0, n1, y) : int4_gemm_vnni<false>(a, in.pairs.data(), w, sz, bits, n, n0, n1, y);
  else if (isa() == Isa::avx512_vnni)  // the AVX2 loops' arithmetic with VNNI's dot products and registers
    six ? int4_gemm_256<true, true>(a, w, sz, bits, n, n0, n1, y) : int4_gemm_256<false, true>(a, w, sz, bits, n, n0, n1, y);
  else
    six ? int4_gemm_256<true, false>(a, w, sz, bits, n, n0, n1, y) : int4_gemm_256<false, false>(a, w, sz, bits, n, n0, n1, y);
}

inline void int8_gemm(const Activations& a, const GemmInputs& in, const int8_t* w, const void* scales, bool bf16_scales, int64_t n, int64_t n0,
                      int64_t n1, float* y) {
  int8_gemm_vnni(a, in.corrections.data(), w, scales, bf16_scales, n, n0, n1, y);
}

}  // namespace lowbit
#else
namespace lowbit {
struct GemmInputs {};
inline bool int4_gemm_applies(const Activations&, const int8_t*) { return false; }
inline bool int8_gemm_applies(const Activations&) { return false; }
inline void prepare_int4(const Activations&, GemmInputs&) {}
inline void prepare_int8(const Activations&, GemmInputs&) {}
inline void int4_gemm(const Activations&, const GemmInputs&, const uint8_t*, const uint16_t*, int, int64_t, int64_t, int64_t, float*) {}
inline void int8_gemm(const Activations&, const GemmInputs&, const int8_t*, const void*, bool, int64_t, int64_t, int64_t, float*) {}
}  // namespace lowbit
#endif
