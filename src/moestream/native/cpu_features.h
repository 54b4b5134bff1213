// What this CPU's vector units can do, asked of the CPU once: every kernel family's dispatch (the int8-activation
// loops, decode attention, the int4 repacking, the import passes) reads this one answer, and each keeps only
// its own cap, which the tests lower to run a plainer CPU's loops.
#pragma once

namespace cpu {
struct Features {
  bool avx2_fma;     // AVX2 with FMA (Intel Haswell, AMD Zen and later)
  bool avx512;       // AVX-512 F, BW, DQ and VL (Intel Skylake-SP, AMD Zen 4 and later)
  bool avx512_vnni;  // and VNNI's int8 dot products (Intel Ice Lake / Cascade Lake, AMD Zen 4 and later)
  bool avx512_bf16;  // and BF16's dot products (Intel Cooper Lake, Sapphire Rapids and later, AMD Zen 4 and later)
};

inline const Features& features() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const Features found = [] {
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    return Features{avx2, avx512, avx512 && __builtin_cpu_supports("avx512vnni"), avx512 && __builtin_cpu_supports("avx512bf16")};
  }();
#else
  static const Features found{false, false, false, false};
#endif
  return found;
}
}  // namespace cpu
