// Compares the CUDA kernels' E2M1 encoder (csrc/cuda/e2m1.h) with the reference-exact comparison ladder
// (csrc/quant.h) on every float32 that is not a NaN, both signs. Also checks the identity the Blackwell path
// relies on (common.cuh: the hardware converts min(|x|, 6), the sign is added after): the ladder's code of x is
// the ladder's code of min(|x|, 6) with x's sign bit. Prints the mismatches; exit code 1 if any.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "cuda/e2m1.h"
#include "quant.h"

int main() {
  unsigned long long mismatches = 0;
  for (uint32_t mag = 0; mag <= 0x7F800000u; ++mag) {  // +0 ... +inf
    for (uint32_t sign : {0u, 0x80000000u}) {
      const uint32_t bits = mag | sign;
      float v;
      std::memcpy(&v, &bits, 4);
      const uint32_t got = vllm_nvfp4::e2m1_code(v), want = vllm_nvfp4::e2m1_encode(v);
      if (got != want && mismatches++ < 10) std::printf("0x%08x: e2m1_code %u, e2m1_encode %u\n", bits, got, want);
      const uint32_t clamped = vllm_nvfp4::e2m1_encode(std::fmin(std::fabs(v), 6.0f)) | (sign >> 28);
      if (clamped != want && mismatches++ < 10)
        std::printf("0x%08x: code of min(|x|, 6) with the sign %u, e2m1_encode %u\n", bits, clamped, want);
    }
  }
  std::printf("%llu mismatches\n", mismatches);
  return mismatches != 0;
}
