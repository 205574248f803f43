/* The GEMV kernel, written once over a small vector vocabulary that each isa_*.c defines
 * before including this file:
 *
 *   vf                      a vector of VW floats
 *   CV                      vectors per 16-byte code chunk (32 rows): 32 / VW
 *   V_ZERO() V_SET1(f) V_FMA(a, b, c) = a * b + c   V_LOAD(p) V_STORE(p, v) (unaligned)
 *   V_LOAD_F16(p)           VW fp16 values at p -> vf
 *   UNPACK(p, q)            16 code bytes at p -> q[0 .. CV-1] = codes of rows 0..31 as floats,
 *                           in natural row order (q[v] holds rows v*VW .. v*VW + VW - 1)
 *   B1_NC                   chunks per row block when batch == 1 (accumulators: B1_NC * CV)
 *   PASS_MAX                batch rows per pass over a 32-row block (accumulators: PASS_MAX * CV)
 *   MAX_ACC                 max(B1_NC, PASS_MAX) * CV
 *   KERNEL_NAME             the exported symbol
 *
 * Every code's term is one FMA on every ISA and at every batch size, so a row's sums are the
 * same floats whatever rows share its call (decode rows equal each row alone: a one-row table
 * lookup of the rounded products q x on AVX-512, 11-13% faster in the kernel alone and nothing
 * end to end, broke that and was dropped).
 *
 * Invariant of the loops: for every group g with kept columns, for every row block, the
 * accumulators hold acc_b[n] = sum_{kept j in g} q_nj * xv_bj, then
 *   y_b[n] += m_ng * xs_bg + d_ng * acc_b[n].
 * Groups are the outer loop so that at most `group` columns are streamed at a time (each
 * column's run of rows is contiguous: a skipped column is a skipped run of bytes). The
 * hardware prefetcher does not follow 16-32 short interleaved runs well: each column's run is
 * prefetched `si4_prefetch_ahead` bytes ahead, continuing into the next group's runs near the
 * end (2x the single-thread bandwidth from DRAM on the Llama-3.2-1B shapes).
 */
#include "sparse_int4.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* What a row block prefetches while it reads column k of its group (k = 0, 1, ...): byte `off`
 * of the run of column cols[first + k], for k < count. */
typedef struct {
    int first, count;
    size_t off;
} prefetch_t;

/* The factors (d, m) of group g for the VW rows from `row`: w = q * d + m. */
ALWAYS_INLINE void load_factors(const si4_matrix *m, int g, int row, vf *d, vf *mn) {
    const size_t at = (size_t)g * 2 * m->npad + row;
    if (m->sz_f16) {
        const uint16_t *dp = (const uint16_t *)m->sz + at;
        *d = V_LOAD_F16(dp);
        *mn = V_LOAD_F16(dp + m->npad);
    } else {
        const float *sp = (const float *)m->sz + at;
        *d = V_LOAD(sp);
        *mn = V_FMA(V_SET1(-8.0f), *d, V_LOAD(sp + m->npad)); /* m = z - 8 s */
    }
}

/* Group g's sums into y: rows b0 .. b0 + BB - 1 of x, NV vectors of W's rows from `row` (acc[b NV + v]):
 * y += m xs + d acc, in this order on every path. */
ALWAYS_INLINE void add_group(const si4_matrix *m, const si4_acts *a, int g, int row, float *ybuf, const int BB,
                             int b0, const int NV, const vf *acc) {
#pragma GCC unroll 8
    for (int b = 0; b < BB; b++) {
        const vf xs = V_SET1(a->xs[(size_t)g * a->batch + b0 + b]);
        float *y = ybuf + (size_t)(b0 + b) * m->npad + row;
#pragma GCC unroll 16
        for (int v = 0; v < NV; v++) {
            vf d, mn;
            load_factors(m, g, row + v * VW, &d, &mn);
            vf yv = V_LOAD(y + v * VW);
            yv = V_FMA(mn, xs, yv);
            yv = V_FMA(d, acc[b * NV + v], yv);
            V_STORE(y + v * VW, yv);
        }
    }
}

/* One row block (NC chunks of 32 rows starting at `row`) of group g, for batch rows b0 .. b0+BB-1. */
ALWAYS_INLINE void block(const si4_matrix *m, const si4_acts *a, int g, int row, float *ybuf,
                         const int BB, const int b0, const int NC, const prefetch_t pf) {
    const int NV = NC * CV;
    vf acc[MAX_ACC];
#pragma GCC unroll 16
    for (int v = 0; v < BB * NV; v++) acc[v] = V_ZERO();

    const uint8_t *base = m->codes + row / 2;
    const size_t stride = m->colstride;
    const int i0 = a->goff[g], i1 = a->goff[g + 1];
    for (int i = i0; i < i1; i++) {
        const uint8_t *p = base + (size_t)a->cols[i] * stride;
        if (i - i0 < pf.count) __builtin_prefetch(m->codes + (size_t)a->cols[pf.first + i - i0] * stride + pf.off, 0, 3);
        const float *x = a->xv + (size_t)b0 * a->xv_stride + i; /* row b: x[b * xv_stride] */
        vf q[MAX_ACC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) UNPACK(p + 16 * c, (q + c * CV));
#pragma GCC unroll 8
        for (int b = 0; b < BB; b++) {
            const vf xb = V_SET1(x[(size_t)b * a->xv_stride]);
#pragma GCC unroll 16
            for (int v = 0; v < NV; v++) acc[b * NV + v] = V_FMA(q[v], xb, acc[b * NV + v]);
        }
    }

    add_group(m, a, g, row, ybuf, BB, b0, NV, acc);
}

/* The software prefetch of a row block at `row`: each column's run pf_rows rows further down,
 * or, near the end of the runs, the start of the next group's runs, so that the stream of
 * lines in flight continues across the group switch. */
ALWAYS_INLINE prefetch_t plan_prefetch(const si4_acts *a, int g, int next, int g1, int row, int row0, int row1,
                                       int pf_rows) {
    prefetch_t pf = {0, 0, 0};
    if (!pf_rows) return pf;
    if (row + pf_rows < row1) {
        pf.first = a->goff[g];
        pf.count = a->goff[g + 1] - a->goff[g];
        pf.off = (size_t)(row + pf_rows) / 2;
    } else if (next < g1 && row0 + (row + pf_rows - row1) < row1) {
        pf.first = a->goff[next];
        pf.count = a->goff[next + 1] - a->goff[next];
        pf.off = (size_t)(row0 + (row + pf_rows - row1)) / 2;
    }
    return pf;
}

#ifdef UNPACKED_ROWS
/* A thread's buffer of `n` floats for a block's unpacked codes (NULL when out of memory: the
 * passes then unpack the codes themselves). */
static float *unpacked_scratch(size_t n) {
    static _Thread_local void *buf;
    static _Thread_local size_t have;
    return si4_reserve(&buf, &have, n * sizeof(float)) ? NULL : buf;
}

/* The codes of group g's kept columns in the 32-row block at `row`, as floats: column i - i0's
 * 32 rows at qb[32 (i - i0)]; each column's run prefetched as `pf` says. */
ALWAYS_INLINE void unpack_block(const si4_matrix *m, const si4_acts *a, int g, int row, const prefetch_t pf,
                                float *qb) {
    const uint8_t *base = m->codes + row / 2;
    const size_t stride = m->colstride;
    const int i0 = a->goff[g], i1 = a->goff[g + 1];
    for (int i = i0; i < i1; i++) {
        if (i - i0 < pf.count) __builtin_prefetch(m->codes + (size_t)a->cols[pf.first + i - i0] * stride + pf.off, 0, 3);
        vf q[CV];
        UNPACK(base + (size_t)a->cols[i] * stride, q);
#pragma GCC unroll 8
        for (int v = 0; v < CV; v++) V_STORE(qb + (size_t)(i - i0) * 32 + v * VW, q[v]);
    }
}

/* Rows b0 .. b0 + BB - 1 of x against 16 rows of W (from `row`) of group g, from the codes as
 * floats (q: column i's 16 rows at q[32 i]) and x transposed (xt: column i's batch rows at
 * xt[i B]): per column two vectors of W and BB broadcasts feed 2 BB multiply-adds, where block's
 * passes of PASS_MAX rows unpack the codes again for each pass. The same multiply-adds in the
 * same order as block's, and the same update of y: the same floats. */
ALWAYS_INLINE void half_unpacked(const si4_matrix *m, const si4_acts *a, int g, int row, float *ybuf, const int BB,
                                 int b0, const float *q, const float *xt) {
    enum { HV = CV / 2 };
    const int n = a->goff[g + 1] - a->goff[g], B = a->batch;
    vf acc[UNPACKED_ROWS * HV];
#pragma GCC unroll 16
    for (int v = 0; v < BB * HV; v++) acc[v] = V_ZERO();
    const float *x = xt + b0;
    for (int i = 0; i < n; i++, q += 32, x += B) {
        vf w[HV];
#pragma GCC unroll 4
        for (int v = 0; v < HV; v++) w[v] = V_LOAD(q + v * VW);
#pragma GCC unroll 8
        for (int b = 0; b < BB; b++) {
            const vf xb = V_SET1(x[b]);
#pragma GCC unroll 4
            for (int v = 0; v < HV; v++) acc[b * HV + v] = V_FMA(w[v], xb, acc[b * HV + v]);
        }
    }
    add_group(m, a, g, row, ybuf, BB, b0, HV, acc);
}
#endif

void KERNEL_NAME(const si4_matrix *m, const si4_acts *a, int row0, int row1, int g0, int g1, float *ybuf) {
    const int B = a->batch;
    for (int b = 0; b < B; b++) {
        float *y = ybuf + (size_t)b * m->npad;
        for (int n = row0; n < row1; n++) y[n] = 0.0f;
    }
    const int pf_rows = 2 * si4_prefetch_ahead; /* rows ahead whose codes are prefetched */
    int next = g0; /* the next group with kept columns */
    for (int g = g0; g < g1; g++) {
        if (a->goff[g] == a->goff[g + 1]) continue; /* nothing kept: nothing read */
        if (next <= g)
            for (next = g + 1; next < g1 && a->goff[next] == a->goff[next + 1]; next++) {}
        if (next < g1) { /* the next group's factors */
            const size_t szb = m->sz_f16 ? 2 : 4;
            const char *sz = (const char *)m->sz + ((size_t)next * 2 * m->npad + row0) * szb;
            __builtin_prefetch(sz, 0, 3);
            __builtin_prefetch(sz + (size_t)m->npad * szb, 0, 3);
        }
        if (B == 1) {
            for (int row = row0; row < row1; row += 32 * B1_NC) {
                const prefetch_t ahead = plan_prefetch(a, g, next, g1, row, row0, row1, pf_rows);
                int nc = (row1 - row) / 32;
                if (nc >= B1_NC) {
                    block(m, a, g, row, ybuf, 1, 0, B1_NC, ahead);
                } else {
                    switch (nc) { /* the tail of the row range */
                    case 1: block(m, a, g, row, ybuf, 1, 0, 1, ahead); break;
#if B1_NC > 2
                    case 2: block(m, a, g, row, ybuf, 1, 0, 2, ahead); break;
#endif
#if B1_NC > 3
                    case 3: block(m, a, g, row, ybuf, 1, 0, 3, ahead); break;
#endif
                    default: break;
                    }
                }
            }
            continue;
        }
#ifdef UNPACKED_ROWS
        float *qb = B > PASS_MAX ? unpacked_scratch((size_t)(a->goff[g + 1] - a->goff[g]) * (32 + B)) : NULL;
        if (qb) { /* the codes unpacked once per block, x transposed once per group (see half_unpacked) */
            float *xt = qb + (size_t)(a->goff[g + 1] - a->goff[g]) * 32;
            for (int i = a->goff[g]; i < a->goff[g + 1]; i++)
                for (int b = 0; b < B; b++) xt[(size_t)(i - a->goff[g]) * B + b] = a->xv[(size_t)b * a->xv_stride + i];
            for (int row = row0; row < row1; row += 32) {
                unpack_block(m, a, g, row, plan_prefetch(a, g, next, g1, row, row0, row1, pf_rows), qb);
                for (int h = 0; h < 2; h++)
                    for (int b0 = 0; b0 < B; b0 += UNPACKED_ROWS) {
                        switch (B - b0 < UNPACKED_ROWS ? B - b0 : UNPACKED_ROWS) {
                        case 1: half_unpacked(m, a, g, row + 16 * h, ybuf, 1, b0, qb + 16 * h, xt); break;
                        case 2: half_unpacked(m, a, g, row + 16 * h, ybuf, 2, b0, qb + 16 * h, xt); break;
                        case 3: half_unpacked(m, a, g, row + 16 * h, ybuf, 3, b0, qb + 16 * h, xt); break;
                        case 4: half_unpacked(m, a, g, row + 16 * h, ybuf, 4, b0, qb + 16 * h, xt); break;
                        case 5: half_unpacked(m, a, g, row + 16 * h, ybuf, 5, b0, qb + 16 * h, xt); break;
                        default: half_unpacked(m, a, g, row + 16 * h, ybuf, UNPACKED_ROWS, b0, qb + 16 * h, xt); break;
                        }
                    }
            }
            continue;
        }
#endif
        /* batch: 32-row blocks, the rows of x in passes of up to PASS_MAX; the block's code
         * bytes are read from memory by the first pass and from L1 by the others. */
        const prefetch_t none = {0, 0, 0};
        for (int row = row0; row < row1; row += 32) {
            const prefetch_t ahead = plan_prefetch(a, g, next, g1, row, row0, row1, pf_rows);
            for (int b0 = 0; b0 < B; b0 += PASS_MAX) {
                const int bb = B - b0 < PASS_MAX ? B - b0 : PASS_MAX;
                switch (bb) {
                case 1: block(m, a, g, row, ybuf, 1, b0, 1, b0 ? none : ahead); break;
                case 2: block(m, a, g, row, ybuf, 2, b0, 1, b0 ? none : ahead); break;
#if PASS_MAX > 2
                case 3: block(m, a, g, row, ybuf, 3, b0, 1, b0 ? none : ahead); break;
                case 4: block(m, a, g, row, ybuf, 4, b0, 1, b0 ? none : ahead); break;
#endif
#if PASS_MAX > 4
                case 5: block(m, a, g, row, ybuf, 5, b0, 1, b0 ? none : ahead); break;
                case 6: block(m, a, g, row, ybuf, 6, b0, 1, b0 ? none : ahead); break;
                case 7: block(m, a, g, row, ybuf, 7, b0, 1, b0 ? none : ahead); break;
                case 8: block(m, a, g, row, ybuf, 8, b0, 1, b0 ? none : ahead); break;
#endif
                default: break;
                }
            }
        }
    }
}

/* The dequantized weight for prefill-sized batches (a dense matmul beats the GEMV from a few
 * dozen rows on): out[(j - j0) * out_stride + (n - row0)] = W[n, j] = q * d + m, for the
 * columns [j0, j1) and the rows [row0, row1) (multiples of 32, row1 <= npad). */
void DEQUANT_NAME(const si4_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride) {
    for (int j = j0; j < j1; j++) {
        const int g = j / m->group;
        const uint8_t *p = m->codes + (size_t)j * m->colstride;
        float *o = out + (size_t)(j - j0) * out_stride - row0;
        for (int row = row0; row < row1; row += 32) {
            vf q[CV];
            UNPACK(p + row / 2, q);
#pragma GCC unroll 32
            for (int v = 0; v < CV; v++) {
                vf d, mn;
                load_factors(m, g, row + v * VW, &d, &mn);
                V_STORE(o + row + v * VW, V_FMA(q[v], d, mn));
            }
        }
    }
}
