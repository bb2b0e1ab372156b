// The AVX-512 CPU store's E2M1 encoder, in a header of its own so that tests/e2m1_avx512_exhaustive.cpp can
// check it against quant.h's e2m1_encode on every float.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace vllm_nvfp4 {

// E2M1 magnitude codes of non-negative, non-NaN lanes, in the low 3 bits (above them, 0x4B000000's bits):
// cuda/e2m1.h's arithmetic form, the minimum of 2a, a + 2 and min(a, 6)/2 + 4, each rounded to an integer (ties
// to even) by adding 2^23. A fused multiply-add rounds once, as the exact products do. The sums are positive
// floats, so their minimum is the minimum of their bits.
__attribute__((target("arch=x86-64-v4"), always_inline)) inline __m512i e2m1_magnitudes_avx512(__m512 a) {
  const __m512 fine = _mm512_fmadd_ps(a, _mm512_set1_ps(2.0f), _mm512_set1_ps(8388608.0f));
  const __m512 mid = _mm512_add_ps(a, _mm512_set1_ps(8388610.0f));
  const __m512 coarse =
      _mm512_fmadd_ps(_mm512_min_ps(a, _mm512_set1_ps(6.0f)), _mm512_set1_ps(0.5f), _mm512_set1_ps(8388612.0f));
  return _mm512_castps_si512(_mm512_min_ps(_mm512_min_ps(fine, mid), coarse));
}

}  // namespace vllm_nvfp4
#endif
