/* AVX-512 variant: compiled with -mavx512f -mavx512bw -mavx512vl -mfma -mf16c (see setup.py),
 * called only when the CPU reports those features. Row block: 128 rows = 8 zmm accumulators. */
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

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
#define DEQUANT_NAME si4_dequant_avx512
#define KERNEL_NAME si4_kernel_avx512

#include "kernel_body.h"

#define V_HSUM(v) _mm512_reduce_add_ps(v)
/* Lane j of the result = the sum of a[j]'s 16 lanes: sixteen horizontal sums by four rounds of
 * halving (pairs of vectors exchange halves and add), 46 operations instead of 16 reductions of
 * 8 or more each. The rounds leave the sums in the lane order undone by the last permute. */
static inline __m512 sums16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int j = 0; j < 8; j++) /* 256-bit halves: key j's in quarters 0-1, key j + 8's in 2-3 */
        b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[j], a[j + 8], 0x44), _mm512_shuffle_f32x4(a[j], a[j + 8], 0xee));
    for (int j = 0; j < 4; j++) /* quarters: keys j, j + 8, j + 4, j + 12 */
        c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[j], b[j + 4], 0x88), _mm512_shuffle_f32x4(b[j], b[j + 4], 0xdd));
    for (int j = 0; j < 2; j++) /* pairs of lanes within each quarter */
        d[j] = _mm512_add_ps(_mm512_shuffle_ps(c[j], c[j + 2], 0x44), _mm512_shuffle_ps(c[j], c[j + 2], 0xee));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xdd));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), e);
}
#include "vexp.h"
#define V_SUMS(a) sums16(a)
#define V_ADD(a, b) _mm512_add_ps((a), (b))
#define V_SUB(a, b) _mm512_sub_ps((a), (b))
#define V_MUL(a, b) _mm512_mul_ps((a), (b))
#define V_MAX(a, b) _mm512_max_ps((a), (b))
#define V_HMAX(v) _mm512_reduce_max_ps(v)
#define V_EXP_NEG(x) exp_neg512(x)
#define S_F16(h) _cvtsh_ss(h)
#define S_TO_F16(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_STORE_F16(p, v) \
    _mm256_storeu_si256((__m256i *)(p), _mm512_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define ATTN_NAME si4_attend_avx512
#define F16_STORE_NAME si4_f16_store_avx512
#define Q8_STORE_NAME si4_q8_store_avx512
#define V_LOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#include "attn_body.h"

#define PREPARE_NAME si4_prepare_avx512
#include "prep_body.h"


/* With AVX-512 VNNI: vpdpbusd multiplies 64 unsigned by 64 signed bytes and sums each four
 * into an int32 lane, so the unsigned side is |qx| and the weights take qx's sign (negated
 * where qx < 0; |W| <= 127 keeps that exact). Lanes 0-7 of a 64-input chunk belong to one
 * block of x, 8-15 to the next: each lane is scaled by its block's dx (a->dxv) and summed in
 * fp32. One row of x: four rows of W share each chunk of x. */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

VNNI static inline __m512 i8_chunk(const int8_t *wp, __mmask64 m, __m512i u, __mmask64 neg, __m512 d, __m512 acc) {
    const __m512i wv = _mm512_maskz_loadu_epi8(m, wp);
    const __m512i sw = _mm512_mask_sub_epi8(wv, neg, _mm512_setzero_si512(), wv);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, sw)), d, acc);
}

VNNI void si8_kernel_avx512vnni(const int8_t *w, const float *scale, int k, const si8_acts *a, int r0, int r1,
                                float *y, size_t y_stride) {
    const int nc = a->kpad / 64;
    const __mmask64 last = k % 64 ? ((__mmask64)1 << (k % 64)) - 1 : ~(__mmask64)0; /* bytes of the last chunk */
    int n = r0;
    if (a->batch == 1) {
        for (; n + 4 <= r1; n += 4) {
            const int8_t *w0 = w + (size_t)n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c = 0; c < nc; c++) {
                const __mmask64 m = c == nc - 1 ? last : ~(__mmask64)0, neg = a->neg[c];
                const __m512i u = _mm512_loadu_si512(a->ax + 64 * c);
                const __m512 d = _mm512_loadu_ps(a->dxv + 16 * c);
                a0 = i8_chunk(w0 + 64 * c, m, u, neg, d, a0);
                a1 = i8_chunk(w1 + 64 * c, m, u, neg, d, a1);
                a2 = i8_chunk(w2 + 64 * c, m, u, neg, d, a2);
                a3 = i8_chunk(w3 + 64 * c, m, u, neg, d, a3);
            }
            y[n] = scale[n] * _mm512_reduce_add_ps(a0);
            y[n + 1] = scale[n + 1] * _mm512_reduce_add_ps(a1);
            y[n + 2] = scale[n + 2] * _mm512_reduce_add_ps(a2);
            y[n + 3] = scale[n + 3] * _mm512_reduce_add_ps(a3);
        }
    }
    /* one row of W at a time for every row of x (the row stays in L1) */
    for (; n < r1; n++) {
        const int8_t *wr = w + (size_t)n * k;
        for (int b = 0; b < a->batch; b++) {
            const uint8_t *ax = a->ax + (size_t)b * a->kpad;
            const uint64_t *neg = a->neg + (size_t)b * nc;
            const float *dxv = a->dxv + (size_t)b * a->kpad / 4;
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < nc; c++)
                acc = i8_chunk(wr + 64 * c, c == nc - 1 ? last : ~(__mmask64)0, _mm512_loadu_si512(ax + 64 * c),
                               neg[c], _mm512_loadu_ps(dxv + 16 * c), acc);
            y[(size_t)b * y_stride + n] = scale[n] * _mm512_reduce_add_ps(acc);
        }
    }
}

#define V_ABS(x) _mm512_abs_ps(x)
#define V_DIV(a, b) _mm512_div_ps((a), (b))
#define V_SELECT_NEG(a, x, y) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((a), _mm512_setzero_ps(), _CMP_LT_OQ), (y), (x))
#define GLU_NAME si4_glu_avx512
#include "glu_body.h"
