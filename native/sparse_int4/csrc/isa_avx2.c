/* AVX2 + FMA variant: compiled with -mavx2 -mfma -mf16c (see setup.py), called only when the
 * CPU reports those features. Row block: 64 rows = 8 ymm accumulators (16 ymm registers). */
#include <immintrin.h>

typedef __m256 vf;
#define VW 8
#define CV 4
#define B1_NC 2
#define PASS_MAX 2
#define MAX_ACC 8
#define V_ZERO() _mm256_setzero_ps()
#define V_SET1(f) _mm256_set1_ps(f)
#define V_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps((p), (v))
#define V_LOAD_F16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
/* bytes 0..7 -> rows 0..7 (low nibbles) and 16..23 (high); bytes 8..15 -> rows 8..15 and 24..31 */
#define UNPACK(p, q)                                                                \
    do {                                                                            \
        const __m256i lo_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)));       \
        const __m256i hi_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8))); \
        const __m256i f_ = _mm256_set1_epi32(15);                                   \
        (q)[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo_, f_));                     \
        (q)[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi_, f_));                     \
        (q)[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo_, 4));                     \
        (q)[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi_, 4));                     \
    } while (0)
#define KERNEL_NAME si4_kernel_avx2

#include "kernel_body.h"

#define PREPARE_NAME si4_prepare_avx2
#include "prep_body.h"
