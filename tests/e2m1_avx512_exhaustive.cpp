// Compares the AVX-512 CPU store's E2M1 encoder (csrc/cpu_e2m1_avx512.h) with quant.h's comparison ladder on
// every non-negative float32 that is not a NaN, inf included (the store feeds it |x| times a finite factor).
// Prints the mismatches; exit code 1 if any.
#include <cstdio>
#include <cstring>

#include "cpu_e2m1_avx512.h"
#include "quant.h"

__attribute__((target("arch=x86-64-v4"))) int main() {
  unsigned long long mismatches = 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (uint32_t first = 0; first <= 0x7F800000u; first += 16) {
    const __m512i bits = _mm512_min_epu32(_mm512_add_epi32(_mm512_set1_epi32(first), lane), _mm512_set1_epi32(0x7F800000));
    uint32_t in[16], got[16];
    _mm512_storeu_si512(in, bits);
    _mm512_storeu_si512(got, vllm_nvfp4::e2m1_magnitudes_avx512(_mm512_castsi512_ps(bits)));
    for (int i = 0; i < 16; ++i) {
      float v;
      std::memcpy(&v, &in[i], 4);
      const uint32_t want = vllm_nvfp4::e2m1_encode(v);
      if ((got[i] & 7u) != want && mismatches++ < 10) std::printf("0x%08x: %u, ladder %u\n", in[i], got[i] & 7u, want);
    }
  }
  std::printf("%llu mismatches\n", mismatches);
  return mismatches != 0;
}
