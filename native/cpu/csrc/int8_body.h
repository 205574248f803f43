/* The per-row INT8 GEMV (see int8_gemv.c), portable form: plain C over the quantized
 * activations, for the portable variant (isa_scalar.c defines I8_NAME and includes this file;
 * AVX2 and AVX-512 VNNI have their own kernels in isa_avx2.c and isa_avx512.c).
 *
 *   y_bn = scale_n * sum_blocks dx_b,blk * sum_{j in blk} W_nj qx_bj
 *
 * The block sums are exact in int32 (|W| <= 127, |qx| <= 127, 32 terms), so every ISA's
 * variant computes the same block sums; only the order of the float sum over blocks differs.
 */
#include "sparse_int4.h"

void I8_NAME(const int8_t *w, const float *scale, int k, const si8_acts *a, int r0, int r1, float *y,
             size_t y_stride) {
    const int nblk = (k + SI8_BLOCK - 1) / SI8_BLOCK;
    for (int n = r0; n < r1; n++) {
        const int8_t *wr = w + (size_t)n * k;
        for (int b = 0; b < a->batch; b++) {
            const int8_t *qx = a->qx + (size_t)b * a->kpad;
            const float *dx = a->dxv + (size_t)b * a->kpad / 4; /* one factor per 4 inputs */
            float acc = 0.0f;
            for (int blk = 0; blk < nblk; blk++) {
                const int j0 = blk * SI8_BLOCK, j1 = j0 + SI8_BLOCK < k ? j0 + SI8_BLOCK : k;
                int32_t s = 0;
                for (int j = j0; j < j1; j++) s += (int32_t)wr[j] * qx[j];
                acc += dx[j0 / 4] * (float)s;
            }
            y[(size_t)b * y_stride + n] = scale[n] * acc;
        }
    }
}
