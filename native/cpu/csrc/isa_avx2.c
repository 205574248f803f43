/* AVX2 + FMA variant: compiled with -mavx2 -mfma -mf16c (see setup.py), called only when the
 * CPU reports those features. Row block: 64 rows = 8 ymm accumulators (16 ymm registers). */
#include <immintrin.h>
#include <string.h>

typedef __m256 vf;
#define VW 8
#define CV 4
#define B1_NC 2
#define PASS_MAX 2
#define UNPACKED_ROWS 6 /* rows of x per pass over codes unpacked once (kernel_body.h) */
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
#define DEQUANT_NAME si4_dequant_avx2
#define KERNEL_NAME si4_kernel_avx2

#include "kernel_body.h"

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define V_HSUM(v) hsum256(v)
/* Lane j of the result = the sum of a[j]'s 8 lanes (isa_avx512.c's sums16 on 8 lanes: 22
 * operations instead of 8 horizontal sums of 6). */
static inline __m256 sums8(const __m256 a[8]) {
    __m256 b[4], c[2];
    for (int j = 0; j < 4; j++) /* 128-bit halves: key j's in the low half, key j + 4's in the high */
        b[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20), _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
    for (int j = 0; j < 2; j++)
        c[j] = _mm256_add_ps(_mm256_shuffle_ps(b[j], b[j + 2], 0x44), _mm256_shuffle_ps(b[j], b[j + 2], 0xee));
    const __m256 e = _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xdd));
    return _mm256_permute_ps(e, 0xd8); /* lanes 0, 2, 1, 3 of each half -> 0, 1, 2, 3 */
}
static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
#include "vexp.h"
#define V_SUMS(a) sums8(a)
#define V_ADD(a, b) _mm256_add_ps((a), (b))
#define V_SUB(a, b) _mm256_sub_ps((a), (b))
#define V_MUL(a, b) _mm256_mul_ps((a), (b))
#define V_MAX(a, b) _mm256_max_ps((a), (b))
#define V_HMAX(v) hmax256(v)
#define V_EXP_NEG(x) exp_neg256(x)
#define S_F16(h) _cvtsh_ss(h)
#define S_TO_F16(f) _cvtss_sh((f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define V_STORE_F16(p, v) \
    _mm_storeu_si128((__m128i *)(p), _mm256_cvtps_ph((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC))
#define ATTN_NAME si4_attend_avx2
#define F16_STORE_NAME si4_f16_store_avx2
#define Q8_STORE_NAME si4_q8_store_avx2
#define V_LOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#include "attn_body.h"

#define PREPARE_NAME si4_prepare_avx2
#include "prep_body.h"

/* The INT8 GEMV (see int8_gemv.c): 32 inputs (one block of x) a step. vpmaddubsw multiplies
 * |qx| (unsigned) by the weights given qx's sign (vpsignb) and adds pairs (at most
 * 2 * 127 * 127: no saturation); vpmaddwd adds pairs again, so each int32 lane holds the sum
 * of four products, scaled by the block's dx and summed in fp32. */
static inline __m256 i8_chunk(__m256i wv, __m256i ux, __m256i sx, __m256 d, __m256 acc) {
    const __m256i p16 = _mm256_maddubs_epi16(ux, _mm256_sign_epi8(wv, sx));
    const __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), d, acc);
}

/* 32 weights at p, of which the first `len` are the row's (the rest read as 0, never past it) */
static inline __m256i i8_load(const int8_t *p, int len) {
    if (len >= 32) return _mm256_loadu_si256((const __m256i *)p);
    int8_t tmp[32] = {0};
    memcpy(tmp, p, (size_t)len);
    return _mm256_loadu_si256((const __m256i *)tmp);
}

void si8_kernel_avx2(const int8_t *w, const float *scale, int k, const si8_acts *a, int r0, int r1, float *y,
                     size_t y_stride) {
    const int nc = (k + 31) / 32;
    int n = r0;
    if (a->batch == 1) {
        for (; n + 4 <= r1; n += 4) {
            const int8_t *w0 = w + (size_t)n * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c = 0; c < nc; c++) {
                const int len = k - 32 * c;
                const __m256i ux = _mm256_loadu_si256((const __m256i *)(a->ax + 32 * c));
                const __m256i sx = _mm256_loadu_si256((const __m256i *)(a->qx + 32 * c));
                const __m256 d = _mm256_loadu_ps(a->dxv + 8 * c);
                a0 = i8_chunk(i8_load(w0 + 32 * c, len), ux, sx, d, a0);
                a1 = i8_chunk(i8_load(w1 + 32 * c, len), ux, sx, d, a1);
                a2 = i8_chunk(i8_load(w2 + 32 * c, len), ux, sx, d, a2);
                a3 = i8_chunk(i8_load(w3 + 32 * c, len), ux, sx, d, a3);
            }
            y[n] = scale[n] * hsum256(a0);
            y[n + 1] = scale[n + 1] * hsum256(a1);
            y[n + 2] = scale[n + 2] * hsum256(a2);
            y[n + 3] = scale[n + 3] * hsum256(a3);
        }
    }
    for (; n < r1; n++) { /* one row of W at a time for every row of x */
        const int8_t *wr = w + (size_t)n * k;
        for (int b = 0; b < a->batch; b++) {
            const uint8_t *ax = a->ax + (size_t)b * a->kpad;
            const int8_t *qx = a->qx + (size_t)b * a->kpad;
            const float *dxv = a->dxv + (size_t)b * a->kpad / 4;
            __m256 acc = _mm256_setzero_ps();
            for (int c = 0; c < nc; c++)
                acc = i8_chunk(i8_load(wr + 32 * c, k - 32 * c), _mm256_loadu_si256((const __m256i *)(ax + 32 * c)),
                               _mm256_loadu_si256((const __m256i *)(qx + 32 * c)), _mm256_loadu_ps(dxv + 8 * c), acc);
            y[(size_t)b * y_stride + n] = scale[n] * hsum256(acc);
        }
    }
}

#define V_ABS(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x))
#define V_DIV(a, b) _mm256_div_ps((a), (b))
#define V_SELECT_NEG(a, x, y) _mm256_blendv_ps((y), (x), (a)) /* by a's sign bit */
#define GLU_NAME si4_glu_avx2
#include "glu_body.h"
