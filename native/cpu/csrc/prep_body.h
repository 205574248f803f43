/* Thresholding and compaction of the activations, done once per call before the row-parallel
 * kernel: for each group, the columns that at least one row of x keeps (|x_bj| > threshold, or
 * every column when dense), each row's value there (0 where that row zeroed the column) and
 * each row's sum of kept values in the group. Branch-free: every column is written at position
 * n_kept, which advances only when the column is kept.
 *
 * Included by each isa_*.c after its vector vocabulary, as PREPARE_NAME. An ISA may define
 * COMPACT16(x, x_stride, batch, j, threshold, dense, cols, xv, xv_stride, n), which does the
 * same for the 16 columns j .. j + 15 of every row at once and advances n.
 */
#include <math.h>
#include <string.h>

#include "sparse_int4.h"

#define ALWAYS_INLINE_P static inline __attribute__((always_inline))

/* Sum of x[j] over the group, keeping only |x[j]| > threshold (all when dense). Eight partial
 * sums: a single running sum would chain one float add latency per input. */
ALWAYS_INLINE_P float group_sum(const float *x, int len, float threshold, int dense) {
    float part[8] = {0};
    int j = 0;
    for (; j + 8 <= len; j += 8)
        for (int l = 0; l < 8; l++) {
            const float v = x[j + l];
            part[l] += (dense | (fabsf(v) > threshold)) ? v : 0.0f;
        }
    for (; j < len; j++) part[0] += (dense | (fabsf(x[j]) > threshold)) ? x[j] : 0.0f;
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

/* Column j of every row: appended at n when any row keeps it; returns the new n. */
ALWAYS_INLINE_P int compact1(const float *x, size_t x_stride, const int batch, int j, float threshold, int dense,
                             int32_t *cols, float *xv, size_t xv_stride, int n) {
    uint32_t any = 0;
    for (int b = 0; b < batch; b++) { /* the value's bits masked by its row's keep */
        const float v = x[(size_t)b * x_stride + j];
        const uint32_t keep = (uint32_t)(dense | (fabsf(v) > threshold));
        uint32_t bits;
        memcpy(&bits, &v, sizeof bits);
        bits &= 0u - keep;
        memcpy(xv + (size_t)b * xv_stride + n, &bits, sizeof bits);
        any |= keep;
    }
    cols[n] = j;
    return n + (int)any;
}

ALWAYS_INLINE_P int compact(const float *x, size_t x_stride, const int batch, int k, int group, float threshold,
                            int dense, int32_t *cols, int32_t *goff, float *xv, size_t xv_stride) {
    const int n_groups = k / group;
    int n = 0;
    for (int g = 0; g < n_groups; g++) {
        goff[g] = n;
        int j = g * group;
#ifdef COMPACT16
        for (; j + 16 <= (g + 1) * group; j += 16)
            n = COMPACT16(x, x_stride, batch, j, threshold, dense, cols, xv, xv_stride, n);
#endif
        for (; j < (g + 1) * group; j++) n = compact1(x, x_stride, batch, j, threshold, dense, cols, xv, xv_stride, n);
    }
    goff[n_groups] = n;
    return n;
}

int PREPARE_NAME(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int dense,
                 int32_t *cols, int32_t *goff, float *xv, float *xs, int32_t *row_counts) {
    const int n_groups = k / group;
    /* per row: group sums and kept counts (vectorisable reductions) */
    for (int b = 0; b < batch; b++) {
        const float *xb = x + (size_t)b * x_stride;
        if (row_counts) {
            int32_t cnt = 0;
            for (int j = 0; j < k; j++) cnt += dense | (fabsf(xb[j]) > threshold);
            row_counts[b] = cnt;
        }
        for (int g = 0; g < n_groups; g++)
            xs[(size_t)g * batch + b] = group_sum(xb + (size_t)g * group, group, threshold, dense);
    }
    if (dense) { /* every column, in order */
        for (int b = 0; b < batch; b++) memcpy(xv + (size_t)b * k, x + (size_t)b * x_stride, sizeof(float) * (size_t)k);
        for (int j = 0; j < k; j++) cols[j] = j;
        for (int g = 0; g <= n_groups; g++) goff[g] = g * group;
        return k;
    }
    /* xv is (batch, k): row b's values of the kept columns at xv[b * k + i] */
    switch (batch) { /* a constant row count lets the compiler unroll the loops over rows */
    case 1: return compact(x, x_stride, 1, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    case 2: return compact(x, x_stride, 2, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    case 3: return compact(x, x_stride, 3, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    case 4: return compact(x, x_stride, 4, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    case 5: return compact(x, x_stride, 5, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    case 6: return compact(x, x_stride, 6, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    case 7: return compact(x, x_stride, 7, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    default: return compact(x, x_stride, 8, k, group, threshold, dense, cols, goff, xv, (size_t)k);
    }
}
