// The CPU kernels' instruction-set variants. Row and tile kernels are compiled for AVX-512, AVX2 and baseline
// x86-64 from the same source, and the best one the CPU supports runs. Avx512Bf16 adds the BF16 dot product
// (Zen 4, Sapphire Rapids), which the indexer logits and the attention scores of bf16 queries use. Amx adds the
// AMX-BF16 tile products (Sapphire Rapids and later), which the attention of bf16 queries over NVFP4 keys uses.
// VLLM_NVFP4_CPU_ISA=avx512bf16|avx512|avx2|baseline caps the choice (avx512bf16 leaves AMX out, avx512 the BF16
// dot product too), so tests can check every variant.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <string>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "error.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define NVFP4_X86 1
#include <immintrin.h>
#define NVFP4_TARGET_AMX __attribute__((target("arch=x86-64-v4,avx512bf16,amx-tile,amx-bf16")))
#define NVFP4_TARGET_AVX512_BF16 __attribute__((target("arch=x86-64-v4,avx512bf16")))
#define NVFP4_TARGET_AVX512 __attribute__((target("arch=x86-64-v4")))
#define NVFP4_TARGET_AVX2 __attribute__((target("arch=x86-64-v3")))
#endif

namespace vllm_nvfp4 {

enum class Isa { Baseline, Avx2, Avx512, Avx512Bf16, Amx };

// Linux gives a process the AMX tile state only when it asks for it (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); until then a tile instruction faults.
inline bool amx_tiles_granted() {
#if defined(__linux__)
  constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
  return false;
#endif
}

inline Isa detect_isa() {
#if NVFP4_X86
  __builtin_cpu_init();
  Isa isa = !__builtin_cpu_supports("x86-64-v4")   ? (__builtin_cpu_supports("x86-64-v3") ? Isa::Avx2 : Isa::Baseline)
            : !__builtin_cpu_supports("avx512bf16") ? Isa::Avx512
                                                    : Isa::Avx512Bf16;
  const char* cap = std::getenv("VLLM_NVFP4_CPU_ISA");
  const std::string name(cap ? cap : "");
  NVFP4_CHECK(!cap || name == "avx512bf16" || name == "avx512" || name == "avx2" || name == "baseline",
              "VLLM_NVFP4_CPU_ISA must be avx512bf16, avx512, avx2 or baseline, got \"", name, "\"");
  if (isa == Isa::Avx512Bf16 && !cap && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
      amx_tiles_granted())
    isa = Isa::Amx;
  if (cap)
    isa = std::min(isa, name == "avx512bf16" ? Isa::Avx512Bf16
                        : name == "avx512"   ? Isa::Avx512
                        : name == "avx2"     ? Isa::Avx2
                                             : Isa::Baseline);
  return isa;
#else
  return Isa::Baseline;
#endif
}

inline Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

}  // namespace vllm_nvfp4
