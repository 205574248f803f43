/* Quantized matrices (qmat.h), AVX2: integer dot products of four columns at a time.
 *
 * For a chunk of 32 rows and four slots (columns), the codes become four vectors W[v] whose
 * int32 element e holds row 8v + e's codes of the four columns in its four bytes; with the four
 * quantized activations broadcast into every element, vpmaddubsw + vpmaddwd give each row's
 * sum of four products in int32 (|q| <= 63 times |qx| <= 127: no int16 saturation; Q8_0's
 * signed codes take the sign of x instead, as |x| * sign(q, x)). The chunk layout (qlayout.py)
 * is chosen so that the byte interleave below yields rows in natural order. Per group, the
 * int32 sums are scaled by D * dx and M * dx * sum(qx) is added, in float32.
 *
 * Compiled with -mavx2 -mfma -mf16c (setup.py); called only on CPUs that have them. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "qmat.h"

#define AI static inline __attribute__((always_inline))
#define PASS 2 /* batch rows per pass over a chunk: 8 accumulators + 4 code vectors */

AI __m256i join(__m128i lo, __m128i hi) { return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1); }

/* The codes of rows 0..31 of four columns' chunks at p[0..3] (see the file comment). */
AI void load_quad(const uint8_t *const p[4], const int BITS, __m256i W[4]) {
    if (BITS == 8) { /* bytes 0..31 of each column: 4 (r / 8) + r % 4 + 16 ((r % 8) / 4) */
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)p[0]), c1 = _mm256_loadu_si256((const __m256i *)p[1]);
        const __m256i c2 = _mm256_loadu_si256((const __m256i *)p[2]), c3 = _mm256_loadu_si256((const __m256i *)p[3]);
        const __m256i a = _mm256_unpacklo_epi8(c0, c1), b = _mm256_unpackhi_epi8(c0, c1);
        const __m256i c = _mm256_unpacklo_epi8(c2, c3), d = _mm256_unpackhi_epi8(c2, c3);
        W[0] = _mm256_unpacklo_epi16(a, c);
        W[1] = _mm256_unpackhi_epi16(a, c);
        W[2] = _mm256_unpacklo_epi16(b, d);
        W[3] = _mm256_unpackhi_epi16(b, d);
        return;
    }
    /* low nibbles: byte 8 (r / 16) + r % 8, nibble (r % 16) / 8 */
    const __m128i c0 = _mm_loadu_si128((const __m128i *)p[0]), c1 = _mm_loadu_si128((const __m128i *)p[1]);
    const __m128i c2 = _mm_loadu_si128((const __m128i *)p[2]), c3 = _mm_loadu_si128((const __m128i *)p[3]);
    const __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpackhi_epi8(c0, c1);
    const __m128i c = _mm_unpacklo_epi8(c2, c3), d = _mm_unpackhi_epi8(c2, c3);
    const __m256i u01 = join(_mm_unpacklo_epi16(a, c), _mm_unpackhi_epi16(a, c)); /* element e: byte e */
    const __m256i u23 = join(_mm_unpacklo_epi16(b, d), _mm_unpackhi_epi16(b, d)); /* element e: byte 8 + e */
    const __m256i f = _mm256_set1_epi8(15);
    W[0] = _mm256_and_si256(u01, f);
    W[1] = _mm256_and_si256(_mm256_srli_epi16(u01, 4), f);
    W[2] = _mm256_and_si256(u23, f);
    W[3] = _mm256_and_si256(_mm256_srli_epi16(u23, 4), f);
    if (BITS == 5) { /* bytes 16..19: byte r % 4, bit 2 (r / 8) + (r % 8) / 4 */
        int32_t h[4];
        for (int t = 0; t < 4; t++) memcpy(&h[t], p[t] + 16, 4);
        const __m128i ab = _mm_unpacklo_epi8(_mm_cvtsi32_si128(h[0]), _mm_cvtsi32_si128(h[1]));
        const __m128i cd = _mm_unpacklo_epi8(_mm_cvtsi32_si128(h[2]), _mm_cvtsi32_si128(h[3]));
        const __m256i hv = _mm256_broadcastsi128_si256(_mm_unpacklo_epi16(ab, cd)); /* element e: byte e % 4 */
        const __m256i sixteen = _mm256_set1_epi8(16);
        for (int v = 0; v < 4; v++) {
            /* elements 0..3 take bit 2v, elements 4..7 bit 2v + 1 */
            const __m256i bit = join(_mm_set1_epi8((char)(1 << (2 * v))), _mm_set1_epi8((char)(1 << (2 * v + 1))));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
            W[v] = _mm256_or_si256(W[v], _mm256_and_si256(set, sixteen));
        }
    } else if (BITS == 6) { /* bytes 16..23: byte r % 8, bits 2 (r / 8) .. + 1 */
        const __m128i ab = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p[0] + 16)),
                                             _mm_loadl_epi64((const __m128i *)(p[1] + 16)));
        const __m128i cd = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(p[2] + 16)),
                                             _mm_loadl_epi64((const __m128i *)(p[3] + 16)));
        const __m256i hv = join(_mm_unpacklo_epi16(ab, cd), _mm_unpackhi_epi16(ab, cd)); /* element e: byte e */
        const __m256i m = _mm256_set1_epi8(0x30);
        W[0] = _mm256_or_si256(W[0], _mm256_and_si256(_mm256_slli_epi16(hv, 4), m));
        W[1] = _mm256_or_si256(W[1], _mm256_and_si256(_mm256_slli_epi16(hv, 2), m));
        W[2] = _mm256_or_si256(W[2], _mm256_and_si256(hv, m));
        W[3] = _mm256_or_si256(W[3], _mm256_and_si256(_mm256_srli_epi16(hv, 2), m));
    }
}

/* The codes of half h (rows 16 h .. 16 h + 15 of the chunk) of the quad at p: W[0] rows
 * 16 h + e, W[1] rows 16 h + 8 + e (element e). */
AI void load_half_il(const uint8_t *p, const int h, const int BITS, __m256i W[2]) {
    if (BITS == 8) {
        W[0] = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
        W[1] = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
        return;
    }
    const __m256i u = _mm256_loadu_si256((const __m256i *)(p + 32 * h)), f = _mm256_set1_epi8(15);
    W[0] = _mm256_and_si256(u, f);
    W[1] = _mm256_and_si256(_mm256_srli_epi16(u, 4), f);
    if (BITS == 5) {
        const __m256i hv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 64)));
        const __m256i sixteen = _mm256_set1_epi8(16);
        for (int t = 0; t < 2; t++) {
            const int v = 2 * h + t;
            const __m256i bit = join(_mm_set1_epi8((char)(1 << (2 * v))), _mm_set1_epi8((char)(1 << (2 * v + 1))));
            const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(hv, bit), bit);
            W[t] = _mm256_or_si256(W[t], _mm256_and_si256(set, sixteen));
        }
    } else if (BITS == 6) {
        const __m256i hv = _mm256_loadu_si256((const __m256i *)(p + 64)), m = _mm256_set1_epi8(0x30);
        if (h == 0) {
            W[0] = _mm256_or_si256(W[0], _mm256_and_si256(_mm256_slli_epi16(hv, 4), m));
            W[1] = _mm256_or_si256(W[1], _mm256_and_si256(_mm256_slli_epi16(hv, 2), m));
        } else {
            W[0] = _mm256_or_si256(W[0], _mm256_and_si256(hv, m));
            W[1] = _mm256_or_si256(W[1], _mm256_and_si256(_mm256_srli_epi16(hv, 2), m));
        }
    }
}

/* The same four vectors from a quad-interleaved chunk at p (qlayout.py, interleaved=True):
 * the bytes already in the order the column layout's interleave produces; the two halves. */
AI void load_quad_il(const uint8_t *p, const int BITS, __m256i W[4]) {
    load_half_il(p, 0, BITS, W);
    load_half_il(p, 1, BITS, W + 2);
}

/* D and M (w = D q + M) of rows n .. n + 7 in group g. */
AI void factors8(const qm_matrix *m, int g, int n, __m256 *D, __m256 *M) {
    const size_t dg = (size_t)g * m->group / m->dgroup, at = (size_t)g * m->npad + n;
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m->d + dg * m->npad + n)));
    if (m->mn) { /* Q4_K / Q5_K: 6-bit scale and min of sub-block g % 8 from 4 + 2 bits */
        const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(m->sc + at)));
        const __m256i hi = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(m->mn + dg * m->npad + n)), 4 * (g % 8));
        const __m256i three = _mm256_set1_epi32(3), fifteen = _mm256_set1_epi32(15);
        const __m256i sc = _mm256_or_si256(_mm256_and_si256(lo, fifteen), _mm256_slli_epi32(_mm256_and_si256(hi, three), 4));
        const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4),
                                           _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2), three), 4));
        d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        *D = d;
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m->m + dg * m->npad + n)));
        *M = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn)));
        return;
    }
    if (m->sc) {
        const __m128i s = _mm_loadl_epi64((const __m128i *)(m->sc + at));
        d = _mm256_mul_ps(d, _mm256_cvtepi32_ps(m->sc_signed ? _mm256_cvtepi8_epi32(s) : _mm256_cvtepu8_epi32(s)));
    }
    *D = d;
    if (m->m) *M = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(m->m + dg * m->npad + n)));
    else *M = _mm256_mul_ps(_mm256_set1_ps((float)-m->off), d);
}

/* Quads whose vpmaddubsw sums int16 lanes can add before they overflow: a lane holds two
 * products q x, |q| <= 2^bits - 1 (Q8_0 through the sign trick: 128), |x| <= 127. */
#define QUADS_PER_I16(BITS) ((BITS) == 4 ? 8 : (BITS) == 5 ? 4 : (BITS) == 6 ? 2 : 1)

/* acc[v] (int16 lanes) += the products of code vectors W[0 .. NV-1] with a quad of activations
 * broadcast in xq; 8-bit codes are signed, so there |x| * sign(q, x), one quad per int16 run
 * (the caller widens after each). */
AI void mac_quad(const __m256i *W, const int NV, __m256i xq, const int BITS, __m256i *acc) {
    if (BITS == 8) {
        const __m256i ax = _mm256_sign_epi8(xq, xq);
        for (int v = 0; v < NV; v++) acc[v] = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(W[v], xq));
        return;
    }
    for (int v = 0; v < NV; v++) acc[v] = _mm256_add_epi16(acc[v], _mm256_maddubs_epi16(W[v], xq));
}

/* The int32 sums of group g over the chunk at `row`, batch rows b0 .. b0 + BB - 1:
 * acc[b][v] element e = sum over the group's slots of q (row + 8v + e) * qx (b0 + b). */
AI void group_sums(const qm_matrix *m, const qm_acts *a, int g, int row, int b0, const int BB, const int BITS,
                   const int IL, int prefetch, __m256i acc[PASS][4]) {
    const size_t choff = (size_t)(row / 32) * (4 * BITS), stride = m->colstride;
    const int s0 = a->goff[g], s1 = a->goff[g + 1];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < BB; b++)
        for (int v = 0; v < 4; v++) acc[b][v] = _mm256_setzero_si256();
    const int pf = prefetch ? si4_prefetch_ahead * BITS / 4 * (IL ? 4 : 1) : 0;
    const size_t tile = ((size_t)g * (m->npad / 32) + row / 32) * (m->group / 4); /* in quads */
    for (int i0 = s0; i0 < s1; i0 += 4 * QUADS_PER_I16(BITS)) {
        const int i1 = i0 + 4 * QUADS_PER_I16(BITS) < s1 ? i0 + 4 * QUADS_PER_I16(BITS) : s1;
        __m256i acc16[PASS][4];
        for (int b = 0; b < BB; b++)
            for (int v = 0; v < 4; v++) acc16[b][v] = _mm256_setzero_si256();
        for (int i = i0; i < i1; i += 4) {
            __m256i W[4];
            if (IL) { /* tiles (group, chunk) of the group's quads: one stream in this loop's order */
                const uint8_t *p = m->codes + (tile + (size_t)(i - s0) / 4) * (16 * BITS);
                if (pf) __builtin_prefetch(p + pf, 0, 3);
                load_quad_il(p, BITS, W);
            } else {
                const uint8_t *p[4];
                for (int t = 0; t < 4; t++) p[t] = m->codes + (size_t)a->cols[i + t] * stride + choff;
                if (pf)
                    for (int t = 0; t < 4; t++) __builtin_prefetch(p[t] + pf, 0, 3);
                load_quad(p, BITS, W);
            }
            for (int b = 0; b < BB; b++) {
                int32_t q4;
                memcpy(&q4, a->qx + (size_t)(b0 + b) * a->qx_stride + i, 4);
                mac_quad(W, 4, _mm256_set1_epi32(q4), BITS, acc16[b]);
            }
        }
        for (int b = 0; b < BB; b++)
            for (int v = 0; v < 4; v++) acc[b][v] = _mm256_add_epi32(acc[b][v], _mm256_madd_epi16(acc16[b][v], ones));
    }
}

/* y (8 rows) += D dx acc + M xs, in this order (both kernels: the same numbers per row). */
AI __m256 flush(__m256 y, __m256 D, __m256 M, float dx, float xs, __m256i acc) {
    const __m256 t = _mm256_fmadd_ps(M, _mm256_set1_ps(xs), y);
    return _mm256_fmadd_ps(_mm256_mul_ps(D, _mm256_set1_ps(dx)), _mm256_cvtepi32_ps(acc), t);
}

/* One pass: batch rows b0 .. b0 + BB - 1 over the chunk at `row` of group g, into ybuf. */
AI void pass(const qm_matrix *m, const qm_acts *a, int g, int row, int b0, const int BB, const int BITS, const int IL,
             int prefetch, float *ybuf) {
    __m256i acc[PASS][4];
    group_sums(m, a, g, row, b0, BB, BITS, IL, prefetch, acc);
    const int qb = g * m->group / QM_QBLOCK, B = a->batch;
    for (int v = 0; v < 4; v++) {
        __m256 D, M;
        factors8(m, g, row + 8 * v, &D, &M);
        for (int b = 0; b < BB; b++) {
            float *y = ybuf + (size_t)(b0 + b) * m->npad + row + 8 * v;
            _mm256_storeu_ps(y, flush(_mm256_loadu_ps(y), D, M, a->dx[(size_t)(b0 + b) * a->dx_stride + qb],
                                      a->xs[(size_t)g * B + b0 + b], acc[b][v]));
        }
    }
}

/* Many rows of x (prefill): chunks of 32 rows outer, every group inner, each pass of two rows
 * of x summing in registers: the chunk's codes of all groups (K / 2 bytes at 4 bits) stay in
 * L1/L2 for every pass, and y is written once (the group-outer loop would read and write all
 * of y once per group). */
AI void wide(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf, const int BITS,
             const int IL) {
    const int B = a->batch, G = g1 - g0;
    __m256 *dm = aligned_alloc(32, sizeof(__m256) * 8 * (size_t)(G > 0 ? G : 1)); /* (group, v, D|M) */
    if (!dm) return;
    for (int row = row0; row < row1; row += 32) {
        for (int g = g0; g < g1; g++)
            for (int v = 0; v < 4; v++) factors8(m, g, row + 8 * v, &dm[((g - g0) * 4 + v) * 2], &dm[((g - g0) * 4 + v) * 2 + 1]);
        for (int b0 = 0; b0 < B; b0 += PASS) {
            const int BB = B - b0 >= 2 ? 2 : 1;
            __m256 y[PASS][4];
            for (int b = 0; b < PASS; b++)
                for (int v = 0; v < 4; v++) y[b][v] = _mm256_setzero_ps();
            for (int g = g0; g < g1; g++) {
                if (a->goff[g] == a->goff[g + 1]) continue;
                __m256i acc[PASS][4];
                const int qb = g * m->group / QM_QBLOCK;
                if (BB == 2) group_sums(m, a, g, row, b0, 2, BITS, IL, 0, acc);
                else group_sums(m, a, g, row, b0, 1, BITS, IL, 0, acc);
                for (int b = 0; b < BB; b++)
                    for (int v = 0; v < 4; v++)
                        y[b][v] = flush(y[b][v], dm[((g - g0) * 4 + v) * 2], dm[((g - g0) * 4 + v) * 2 + 1],
                                        a->dx[(size_t)(b0 + b) * a->dx_stride + qb], a->xs[(size_t)g * B + b0 + b], acc[b][v]);
            }
            for (int b = 0; b < BB; b++)
                for (int v = 0; v < 4; v++) _mm256_storeu_ps(ybuf + (size_t)(b0 + b) * m->npad + row + 8 * v, y[b][v]);
        }
    }
    free(dm);
}

/* ---------------------------------------------------------------- quads of columns, few rows of x
 *
 * The interleaved layout with up to SI4_MAX_BATCH rows of x (decode steps, verification of
 * drafted tokens, batches): groups outer (the tiles' order in memory, one stream), chunks of 32
 * rows inner, each chunk in two halves of 16 rows. A half's codes are one 32-byte load per quad
 * (plus the high-bit plane), unpacked once and multiplied with NB rows of x at a time, so that
 * the sums of NB rows stay in registers; the factors of a half are computed once for every row
 * of x. Per row of x the float operations are those of `flush`, in the same order at every
 * batch size: a row's result does not depend on the rows decoded beside it. */

/* Rows of x per pass over a half: the int16 and int32 sums of NB rows, two code vectors and the
 * broadcast activations fit the 16 registers (4-bit and 8-bit codes need no int16 stage that
 * outlives a quad block; 5 and 6 bits sum int16 over 4 and 2 quads before widening). */
#define NB_FOR(BITS) ((BITS) == 4 || (BITS) == 8 ? 4 : 2)

/* acc[b][t] element e = sum over the group's nq quads (at p, quad stride qbytes) of
 * q(row 16 h + 8 t + e) * qx, for the BB rows of x at qx[b * qs]. */
AI void half_sums(const uint8_t *p, size_t qbytes, int nq, const int8_t *qx, size_t qs, const int h, const int BB,
                  const int BITS, int pf, __m256i acc[4][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < BB; b++) acc[b][0] = acc[b][1] = _mm256_setzero_si256();
    for (int i0 = 0; i0 < nq; i0 += QUADS_PER_I16(BITS)) {
        const int i1 = i0 + QUADS_PER_I16(BITS) < nq ? i0 + QUADS_PER_I16(BITS) : nq;
        __m256i s16[4][2];
        for (int b = 0; b < BB; b++) s16[b][0] = s16[b][1] = _mm256_setzero_si256();
        for (int i = i0; i < i1; i++) {
            const uint8_t *q = p + (size_t)i * qbytes;
            if (pf) __builtin_prefetch(q + pf, 0, 3);
            __m256i W[2];
            load_half_il(q, h, BITS, W);
            for (int b = 0; b < BB; b++) {
                int32_t q4;
                memcpy(&q4, qx + (size_t)b * qs + 4 * i, 4);
                mac_quad(W, 2, _mm256_set1_epi32(q4), BITS, s16[b]);
            }
        }
        for (int b = 0; b < BB; b++)
            for (int t = 0; t < 2; t++) acc[b][t] = _mm256_add_epi32(acc[b][t], _mm256_madd_epi16(s16[b][t], ones));
    }
}

/* One pass of BB rows of x (from b0) over half h of a chunk: sums, then flush into y. */
AI void half_pass(const uint8_t *p, size_t qbytes, int nq, const int8_t *qx, size_t qs, const int h, const int BB,
                  const int BITS, int pf, const __m256 D[2], const __m256 M[2], const float *dxg, const float *xsg,
                  float *y, size_t ys) {
    __m256i acc[4][2];
    half_sums(p, qbytes, nq, qx, qs, h, BB, BITS, pf, acc);
    for (int b = 0; b < BB; b++)
        for (int t = 0; t < 2; t++) {
            float *yb = y + (size_t)b * ys + 8 * t;
            _mm256_storeu_ps(yb, flush(_mm256_loadu_ps(yb), D[t], M[t], dxg[b], xsg[b], acc[b][t]));
        }
}

AI void kernel_il(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf,
                  const int BITS) {
    const int NB = NB_FOR(BITS);
    const int B = a->batch, npad = m->npad, nq = m->group / 4;
    const size_t qbytes = 16 * BITS, chunk_bytes = (size_t)nq * qbytes, qs = a->qx_stride;
    const int pf0 = si4_prefetch_ahead * BITS / 4 * 4;
    /* Up to 8 rows of x: every group over all the rows (one stream; y of 8 rows stays in L2).
     * More (prefill): blocks of 256 rows, so that y of every row of x stays in L2 while the
     * groups go by, and each half's factors serve B / NB passes. */
    const int rows_per_block = B > SI4_MAX_BATCH ? 256 : row1 - row0;
    for (int rb0 = row0; rb0 < row1; rb0 += rows_per_block) {
        const int rb1 = rb0 + rows_per_block < row1 ? rb0 + rows_per_block : row1;
        for (int b = 0; b < B; b++) memset(ybuf + (size_t)b * npad + rb0, 0, sizeof(float) * (size_t)(rb1 - rb0));
        for (int g = g0; g < g1; g++) {
            const int qb = g * m->group / QM_QBLOCK;
            float dxg[QM_MAX_BATCH], xsg[QM_MAX_BATCH];
            for (int b = 0; b < B; b++) {
                dxg[b] = a->dx[(size_t)b * a->dx_stride + qb];
                xsg[b] = a->xs[(size_t)g * B + b];
            }
            const int8_t *qx = a->qx + a->goff[g];
            const uint8_t *tiles = m->codes + (size_t)g * (npad / 32) * chunk_bytes;
            for (int row = rb0; row < rb1; row += 32) {
                const uint8_t *p = tiles + (size_t)(row / 32) * chunk_bytes;
                for (int h = 0; h < 2; h++) {
                    __m256 D[2], M[2];
                    for (int t = 0; t < 2; t++) factors8(m, g, row + 16 * h + 8 * t, &D[t], &M[t]);
                    float *y = ybuf + row + 16 * h;
                    for (int b0 = 0; b0 < B; b0 += NB) {
                        const int pf = h == 0 && b0 == 0 ? pf0 : 0; /* each line once, ahead of the stream */
                        const int8_t *qb0 = qx + (size_t)b0 * qs;
                        float *yb0 = y + (size_t)b0 * npad;
                        switch (B - b0 < NB ? B - b0 : NB) {
                        case 1: half_pass(p, qbytes, nq, qb0, qs, h, 1, BITS, pf, D, M, dxg + b0, xsg + b0, yb0, npad); break;
                        case 2: half_pass(p, qbytes, nq, qb0, qs, h, 2, BITS, pf, D, M, dxg + b0, xsg + b0, yb0, npad); break;
                        case 3: /* only where NB is 4 */
                            half_pass(p, qbytes, nq, qb0, qs, h, NB > 2 ? 3 : 1, BITS, pf, D, M, dxg + b0, xsg + b0, yb0, npad);
                            break;
                        default:
                            half_pass(p, qbytes, nq, qb0, qs, h, NB > 2 ? 4 : 1, BITS, pf, D, M, dxg + b0, xsg + b0, yb0, npad);
                            break;
                        }
                    }
                }
            }
        }
    }
}

AI void kernel(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf, const int BITS,
              const int IL) {
    const int B = a->batch, cb = 4 * BITS;
    /* 8-bit codes with one or two rows of x: the whole-chunk passes below are faster
     * (measured: 137 against 190 us for one row of a 2048 x 1536 Q8_0 on one thread); both give
     * the same numbers per row. */
    if (IL && (BITS != 8 || B > 2)) {
        kernel_il(m, a, row0, row1, g0, g1, ybuf, BITS);
        return;
    }
    if (B > SI4_MAX_BATCH) {
        wide(m, a, row0, row1, g0, g1, ybuf, BITS, IL);
        return;
    }
    for (int b = 0; b < B; b++) memset(ybuf + (size_t)b * m->npad + row0, 0, sizeof(float) * (size_t)(row1 - row0));
    for (int g = g0; g < g1; g++) {
        if (a->goff[g] == a->goff[g + 1]) continue; /* nothing kept: nothing read */
        for (int row = row0; row < row1; row += 32) {
            /* prefetch once per cache line of each column's run, on the first pass */
            const int line = IL || (int)(((size_t)(row / 32) * cb) % 64) < cb;
            for (int b0 = 0; b0 < B; b0 += PASS) {
                if (B - b0 >= 2) pass(m, a, g, row, b0, 2, BITS, IL, line && !b0, ybuf);
                else pass(m, a, g, row, b0, 1, BITS, IL, line && !b0, ybuf);
            }
        }
    }
}

/* CALL(BITS, IL) with m's bit width and layout as compile-time constants. */
#define BY_FORMAT(m, CALL)                                                                    \
    switch ((m)->bits * 2 + !!(m)->interleaved) {                                             \
    case 8: CALL(4, 0); break;                                                                \
    case 9: CALL(4, 1); break;                                                                \
    case 10: CALL(5, 0); break;                                                               \
    case 11: CALL(5, 1); break;                                                               \
    case 12: CALL(6, 0); break;                                                               \
    case 13: CALL(6, 1); break;                                                               \
    case 16: CALL(8, 0); break;                                                               \
    default: CALL(8, 1); break;                                                               \
    }

void qm_kernel_avx2(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf) {
#define KERNEL(BITS, IL) kernel(m, a, row0, row1, g0, g1, ybuf, BITS, IL)
    BY_FORMAT(m, KERNEL)
#undef KERNEL
}

/* Columns [j0, j1), rows [row0, row1) of W as float32, transposed (qmat.h), a quad of columns
 * and 32 rows at a time through the kernels' own code loads. */
AI void dequant(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride, const int BITS,
                const int IL) {
    const int cb = 4 * BITS;
    for (int j = j0 & ~3; j < j1; j += 4) {
        const int g = j / m->group;
        for (int row = row0; row < row1; row += 32) {
            __m256i W[4];
            if (IL) {
                const size_t tile = ((size_t)g * (m->npad / 32) + row / 32) * (m->group / 4);
                load_quad_il(m->codes + (tile + (size_t)(j % m->group) / 4) * (4 * cb), BITS, W);
            } else {
                const uint8_t *p[4];
                for (int t = 0; t < 4; t++) p[t] = m->codes + (size_t)(j + t) * m->colstride + (size_t)(row / 32) * cb;
                load_quad(p, BITS, W);
            }
            for (int v = 0; v < 4; v++) {
                __m256 D, M;
                factors8(m, g, row + 8 * v, &D, &M);
                for (int t = 0; t < 4; t++) {
                    if (j + t < j0 || j + t >= j1) continue;
                    const __m256i q = BITS == 8 ? _mm256_srai_epi32(_mm256_slli_epi32(W[v], 24 - 8 * t), 24)
                                                : _mm256_and_si256(_mm256_srli_epi32(W[v], 8 * t), _mm256_set1_epi32(255));
                    float *o = out + (size_t)(j + t - j0) * out_stride + (row - row0) + 8 * v;
                    _mm256_storeu_ps(o, _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(q), M));
                }
            }
        }
    }
}

void qm_dequant_avx2(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride) {
#define DEQUANT(BITS, IL) dequant(m, j0, j1, row0, row1, out, out_stride, BITS, IL)
    BY_FORMAT(m, DEQUANT)
#undef DEQUANT
}

/* qm_dense_prepare (qmat_scalar.c) eight inputs at a time: the same float operations
 * (vcvtps2dq rounds to nearest even, as lrintf), so every ISA gives the same qx, dx and xs. */
void qm_dense_prepare_avx2(const float *x, size_t x_stride, int batch, int k, int group, int8_t *qx,
                           size_t qx_stride, float *dx, size_t dx_stride, float *xs) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int b = 0; b < batch; b++) {
        const float *xb = x + (size_t)b * x_stride;
        int8_t *qb = qx + (size_t)b * qx_stride;
        for (int q = 0; q < k / QM_QBLOCK; q++) {
            const float *p = xb + q * QM_QBLOCK;
            __m256 v[4], mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(p + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            const float d = _mm_cvtss_f32(m4) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
            dx[(size_t)b * dx_stride + q] = d;
            const __m256 idv = _mm256_set1_ps(id);
            __m256i r[4];
            for (int i = 0; i < 4; i++) r[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));
            /* int32 -> int8, in order: packs work within 128-bit lanes, a permute restores it */
            const __m256i w01 = _mm256_packs_epi32(r[0], r[1]), w23 = _mm256_packs_epi32(r[2], r[3]);
            const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23),
                                                              _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(qb + q * QM_QBLOCK), bytes);
        }
        for (int g = 0; g < k / group; g++) {
            int32_t isum = 0;
            for (int j = g * group; j < (g + 1) * group; j++) isum += qb[j];
            xs[(size_t)g * batch + b] = (float)isum * dx[(size_t)b * dx_stride + g * group / QM_QBLOCK];
        }
    }
}
