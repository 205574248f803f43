/* The per-row INT8 GEMV: y = W x for an output head (vocab x d int8, one scale per row), the
 * largest single weight a decode step reads.
 *
 * x is quantized once per call, in blocks of SI8_BLOCK inputs, to int8 with one float factor
 * per block (dx = max |x| / 127, qx = round(x / dx)): the same activation quantization as
 * llama.cpp's Q8_0 matmul, and what lets the AVX-512 VNNI kernel multiply 64 bytes by 64
 * bytes in one instruction (int8 -> float conversion and FMA of every weight measured 6 GB/s
 * per core from memory, the VNNI kernel 12 GB/s on this machine: the head is then
 * memory-bound). Rows are independent: the pool's threads take pieces of rows.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "sparse_int4.h"

#define PIECE_ROWS 256

static struct { /* scratch, under the caller's lock */
    int8_t *qx;
    uint8_t *ax;
    uint64_t *neg;
    float *dxv;
    size_t cap; /* rows x kpad bytes the buffers hold */
} S;

static int reserve(size_t bytes) {
    if (bytes <= S.cap) return 0;
    free(S.qx), free(S.ax), free(S.neg), free(S.dxv);
    S.qx = aligned_alloc(64, bytes);
    S.ax = aligned_alloc(64, bytes);
    S.neg = aligned_alloc(64, bytes / 8);
    S.dxv = aligned_alloc(64, bytes); /* bytes / 4 floats */
    S.cap = S.qx && S.ax && S.neg && S.dxv ? bytes : 0;
    return S.cap ? 0 : -1;
}

/* Row b of x -> its quantized form in S (kpad inputs, zero past k). */
static void quantize_row(const float *x, int k, int kpad, int8_t *qx, uint8_t *ax, uint64_t *neg, float *dxv) {
    memset(qx, 0, (size_t)kpad);
    memset(ax, 0, (size_t)kpad);
    memset(neg, 0, (size_t)kpad / 8);
    memset(dxv, 0, sizeof(float) * (size_t)kpad / 4);
    for (int j0 = 0; j0 < k; j0 += SI8_BLOCK) {
        const int j1 = j0 + SI8_BLOCK < k ? j0 + SI8_BLOCK : k;
        float amax = 0.0f;
        for (int j = j0; j < j1; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int j = j0; j < j1; j++) {
            const int q = (int)roundf(x[j] * id); /* |q| <= 127 */
            qx[j] = (int8_t)q;
            ax[j] = (uint8_t)(q < 0 ? -q : q);
            if (q < 0) neg[j / 64] |= (uint64_t)1 << (j % 64);
        }
        for (int i = j0 / 4; i < (j1 + 3) / 4; i++) dxv[i] = d;
    }
}

typedef struct {
    si8_kernel_fn kernel;
    const int8_t *w;
    const float *scale;
    const si8_acts *a;
    float *y;
    size_t y_stride;
    int n, k;
    atomic_int next; /* the next piece of PIECE_ROWS rows */
} job_t;

static void run_part(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    job_t *j = arg;
    const int pieces = (j->n + PIECE_ROWS - 1) / PIECE_ROWS;
    for (int c; (c = atomic_fetch_add(&j->next, 1)) < pieces;) {
        const int r0 = c * PIECE_ROWS, r1 = r0 + PIECE_ROWS < j->n ? r0 + PIECE_ROWS : j->n;
        j->kernel(j->w, j->scale, j->k, j->a, r0, r1, j->y, j->y_stride);
    }
}

int si8_gemv(si8_kernel_fn kernel, int parts, const int8_t *w, const float *scale, int n, int k, const float *x,
             size_t x_stride, int batch, float *y, size_t y_stride) {
    const int kpad = (k + 63) / 64 * 64;
    if (reserve((size_t)SI4_MAX_BATCH * kpad)) return -1;
    if (parts > si4_pool_size()) parts = si4_pool_size();
    if (parts < 1) parts = 1;
    for (int b0 = 0; b0 < batch; b0 += SI4_MAX_BATCH) { /* W is read once per SI4_MAX_BATCH rows of x */
        const int bb = batch - b0 < SI4_MAX_BATCH ? batch - b0 : SI4_MAX_BATCH;
        for (int b = 0; b < bb; b++)
            quantize_row(x + (size_t)(b0 + b) * x_stride, k, kpad, S.qx + (size_t)b * kpad, S.ax + (size_t)b * kpad,
                         S.neg + (size_t)b * kpad / 64, S.dxv + (size_t)b * kpad / 4);
        const si8_acts a = {.batch = bb, .k = k, .kpad = kpad, .qx = S.qx, .ax = S.ax, .neg = S.neg, .dxv = S.dxv};
        job_t job = {.kernel = kernel, .w = w, .scale = scale, .a = &a, .y = y + (size_t)b0 * y_stride,
                     .y_stride = y_stride, .n = n, .k = k};
        atomic_init(&job.next, 0);
        si4_pool_run(run_part, &job, parts);
    }
    return 0;
}
