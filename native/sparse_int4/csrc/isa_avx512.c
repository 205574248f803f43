/* AVX-512 variant: compiled with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c (see setup.py),
 * called only when the CPU reports those features. Row block: 128 rows = 8 zmm accumulators. */
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>

typedef __m512 vf;
#define VW 16
#define CV 2
#define B1_NC 4
#define PASS_MAX 8
#define MAX_ACC 16
#define V_ZERO() _mm512_setzero_ps()
#define V_SET1(f) _mm512_set1_ps(f)
#define V_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps((p), (v))
#define V_LOAD_F16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
/* 16 bytes -> 16 dwords; low nibbles are rows 0..15, high nibbles rows 16..31 */
#define UNPACK(p, q)                                                              \
    do {                                                                          \
        const __m512i w_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))); \
        (q)[0] = _mm512_cvtepi32_ps(_mm512_and_si512(w_, _mm512_set1_epi32(15))); \
        (q)[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w_, 4));                    \
    } while (0)
/* vpermps reads only the low 4 bits of each index: the zero-extended byte indexes its low
 * nibble as is, and its high nibble after a shift. Fewer uops on the two 512-bit ports than
 * convert + FMA (the product is rounded before the add: one more rounding per term). */
#define LOOKUP_TABLE(x) _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(x))
#define LOOKUP_ACC(p, tbl, acc)                                                   \
    do {                                                                          \
        const __m512i w_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))); \
        (acc)[0] = _mm512_add_ps((acc)[0], _mm512_permutexvar_ps(w_, (tbl)));      \
        (acc)[1] = _mm512_add_ps((acc)[1], _mm512_permutexvar_ps(_mm512_srli_epi32(w_, 4), (tbl))); \
    } while (0)
/* Columns j .. j+15 of every row: the union of the rows' keep masks compresses the indices
 * and each row's values (zeroed where that row does not keep them) to position n. The lanes
 * stored past the kept ones are scratch, overwritten by the next step. */
static inline __attribute__((always_inline)) int compact16(const float *x, size_t x_stride, const int batch, int j,
                                                           float t, int dense, int32_t *cols, float *xv,
                                                           size_t xv_stride, int n) {
    __m512 v[8];
    __mmask16 keep[8], any = 0;
    for (int b = 0; b < batch; b++) {
        v[b] = _mm512_loadu_ps(x + (size_t)b * x_stride + j);
        keep[b] = dense ? (__mmask16)0xffff : _mm512_cmp_ps_mask(_mm512_abs_ps(v[b]), _mm512_set1_ps(t), _CMP_GT_OQ);
        any |= keep[b];
    }
    for (int b = 0; b < batch; b++)
        _mm512_storeu_ps(xv + (size_t)b * xv_stride + n, _mm512_maskz_compress_ps(any, _mm512_maskz_mov_ps(keep[b], v[b])));
    const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(j), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    _mm512_storeu_si512(cols + n, _mm512_maskz_compress_epi32(any, idx));
    return n + __builtin_popcount((unsigned)any);
}
#define COMPACT16 compact16
#define KERNEL_NAME si4_kernel_avx512

#include "kernel_body.h"

#define PREPARE_NAME si4_prepare_avx512
#include "prep_body.h"
