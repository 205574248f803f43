/* Shared declarations of the sparse INT4 GEMV library (see ../layout.py for the byte layout).
 *
 * W (N x K) is stored column-major in 4-bit codes: column j occupies `colstride` = npad / 2
 * contiguous bytes, npad = N rounded up to 32. Inside a column, 16-byte chunk c holds rows
 * 32c .. 32c + 31: byte b has row 32c + b in its low nibble and row 32c + 16 + b in its high
 * nibble. Per (group g of `group` inputs, row n) there is one pair of factors, stored as
 * sz[g][0][n] and sz[g][1][n] (npad entries each):
 *   sz_f16 = 1: fp16 (d, m),  w = q * d + m
 *   sz_f16 = 0: fp32 (s, z),  w = (q - 8) * s + z,  used as d = s, m = z - 8 s
 * so that  y_n = sum_g [ d_ng * sum_{j in g} q_nj x_j  +  m_ng * sum_{j in g} x_j ].
 */
#ifndef LLMLOCAL_SPARSE_INT4_H
#define LLMLOCAL_SPARSE_INT4_H

#include <stddef.h>
#include <stdint.h>

#define SI4_MAX_BATCH 8
#define SI4_CHUNK_ROWS 32 /* rows per 16-byte code chunk */
#define SI4_UNIT_ROWS 128 /* rows per 64-byte line of a column: the unit threads split on */

typedef struct {
    const uint8_t *codes; /* (K, colstride) */
    const void *sz;       /* (G, 2, npad) fp16 or fp32 */
    int n, npad, k, group, sz_f16;
    size_t colstride;     /* npad / 2 */
} si4_matrix;

/* The activations after thresholding, compacted per group (built by si4_prepare). */
typedef struct {
    int batch;            /* rows of x: 1 .. SI4_MAX_BATCH */
    int n_groups;
    int n_kept;           /* columns kept by at least one row */
    const int32_t *cols;  /* (n_kept,) kept column indices, ascending */
    const int32_t *goff;  /* (n_groups + 1,) kept columns of group g: cols[goff[g] .. goff[g+1]) */
    const float *xv;      /* (batch, xv_stride): row b's values of the kept columns, 0 where it zeroed one */
    size_t xv_stride;     /* k */
    const float *xs;      /* (n_groups, batch) sum of a row's kept values in each group */
} si4_acts;

/* Bytes ahead in a column's run that the kernels prefetch (0: none; a tuning knob). */
extern int si4_prefetch_ahead;


/* Computes rows [row0, row1) (multiples of 32, row1 <= npad) of the partial product over the
 * groups [g0, g1) (the input columns [g0 * group, g1 * group)), for every batch row, into
 * ybuf[b * npad + n]; overwrites them. */
typedef void (*si4_kernel_fn)(const si4_matrix *m, const si4_acts *a, int row0, int row1, int g0, int g1,
                              float *ybuf);

void si4_kernel_scalar(const si4_matrix *m, const si4_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
#ifdef LLMLOCAL_X86_VARIANTS
void si4_kernel_avx2(const si4_matrix *m, const si4_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
void si4_kernel_avx512(const si4_matrix *m, const si4_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
#endif

/* Columns [j0, j1), rows [row0, row1) (multiples of 32) of the dequantized W, column after
 * column: out[(j - j0) * out_stride + n - row0] (see kernel_body.h). */
typedef void (*si4_dequant_fn)(const si4_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride);
void si4_dequant_scalar(const si4_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride);
#ifdef LLMLOCAL_X86_VARIANTS
void si4_dequant_avx2(const si4_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride);
void si4_dequant_avx512(const si4_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride);
#endif

/* Thresholds x and compacts it into the arrays of si4_acts; returns n_kept. Buffers: cols (k),
 * goff (k / group + 1), xv (k * batch), xs (k / group * batch); row_counts (batch) may be NULL. */
typedef int (*si4_prepare_fn)(const float *x, size_t x_stride, int batch, int k, int group, float threshold,
                              int dense, int32_t *cols, int32_t *goff, float *xv, float *xs, int32_t *row_counts);
int si4_prepare_scalar(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int dense,
                       int32_t *cols, int32_t *goff, float *xv, float *xs, int32_t *row_counts);
#ifdef LLMLOCAL_X86_VARIANTS
int si4_prepare_avx2(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int dense,
                     int32_t *cols, int32_t *goff, float *xv, float *xs, int32_t *row_counts);
int si4_prepare_avx512(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int dense,
                       int32_t *cols, int32_t *goff, float *xv, float *xs, int32_t *row_counts);
#endif

/* The per-row INT8 GEMV (int8_gemv.c): W (N x K) int8 row-major, values in [-127, 127], one
 * float scale per row; x is quantized to int8 in blocks of SI8_BLOCK inputs (dx = max |x| / 127,
 * qx = round(x / dx)), as llama.cpp quantizes the activations of a Q8_0 matmul. */
#define SI8_BLOCK 32
typedef struct {
    int batch, k, kpad;  /* kpad: k rounded up to 64 */
    const int8_t *qx;    /* (batch, kpad) quantized x, 0 past k */
    const uint8_t *ax;   /* (batch, kpad) |qx| */
    const uint64_t *neg; /* (batch, kpad / 64) bit j of word c: qx[64 c + j] < 0 */
    const float *dxv;    /* (batch, kpad / 4) dx of the block holding inputs 4i .. 4i + 3 */
} si8_acts;

/* Rows [r0, r1) of y (batch rows of y_stride floats) = W x for the quantized x in a. */
typedef void (*si8_kernel_fn)(const int8_t *w, const float *scale, int k, const si8_acts *a, int r0, int r1, float *y,
                              size_t y_stride);
void si8_kernel_scalar(const int8_t *w, const float *scale, int k, const si8_acts *a, int r0, int r1, float *y,
                       size_t y_stride);
#ifdef LLMLOCAL_X86_VARIANTS
void si8_kernel_avx2(const int8_t *w, const float *scale, int k, const si8_acts *a, int r0, int r1, float *y,
                     size_t y_stride);
void si8_kernel_avx512vnni(const int8_t *w, const float *scale, int k, const si8_acts *a, int r0, int r1, float *y,
                           size_t y_stride);
#endif

/* y = W x for `batch` rows of x (any count), on up to `parts` threads of the pool; -1 when out
 * of memory. The caller holds the library's call lock (the scratch buffers are shared). */
int si8_gemv(si8_kernel_fn kernel, int parts, const int8_t *w, const float *scale, int n, int k, const float *x,
             size_t x_stride, int batch, float *y, size_t y_stride);

/* One (sequence, chunk of its context) unit of decode attention (attn_body.h; DecodeStack). */
#define SI4_MAX_HEADS 256
/* What a KV cache holds: floats, fp16 values, or q8_0 rows (per KV head: hd int8 values, then
 * an fp16 scale per 32 of them; a position's row is n_kv * (hd + hd / 16) bytes) */
enum { SI4_KV_F32 = 0, SI4_KV_F16 = 1, SI4_KV_Q8 = 2 };
typedef struct {
    const float *q;       /* (n_kv * group, hd): the sequence's query heads */
    const void *kc, *vc;  /* the layer's caches: position slot s's row at s * (n_kv heads' bytes) */
    int kv_type;          /* SI4_KV_* */
    const int64_t *slots; /* the unit's n_ctx context slots */
    int n_ctx, n_kv, group, hd;
    float scale;
    float *scores; /* (n_kv * group, n_ctx) scratch */
    float *out;    /* (n_kv * group, hd) */
    float *m, *l;  /* NULL: the whole context, out normalised; else a chunk's per-head max and sum */
} si4_attn_unit;
typedef void (*si4_attend_fn)(const si4_attn_unit *u);
void si4_attend_scalar(const si4_attn_unit *u);
typedef void (*si4_f16_store_fn)(uint16_t *dst, const float *src, int n);
void si4_f16_store_scalar(uint16_t *dst, const float *src, int n);
typedef void (*si4_q8_store_fn)(int8_t *dst, const float *src, int n_heads, int hd);
void si4_q8_store_scalar(int8_t *dst, const float *src, int n_heads, int hd);
/* out[i] = act(gate[i]) * up[i], i < n; activation 0 silu, 1 gelu-tanh (glu_body.h) */
typedef void (*si4_glu_fn)(const float *gate, const float *up, float *out, int n, int activation);
void si4_glu_scalar(const float *gate, const float *up, float *out, int n, int activation);
#ifdef LLMLOCAL_X86_VARIANTS
void si4_glu_avx2(const float *gate, const float *up, float *out, int n, int activation);
void si4_glu_avx512(const float *gate, const float *up, float *out, int n, int activation);
void si4_attend_avx2(const si4_attn_unit *u);
void si4_attend_avx512(const si4_attn_unit *u);
void si4_f16_store_avx2(uint16_t *dst, const float *src, int n);
void si4_f16_store_avx512(uint16_t *dst, const float *src, int n);
void si4_q8_store_avx2(int8_t *dst, const float *src, int n_heads, int hd);
void si4_q8_store_avx512(int8_t *dst, const float *src, int n_heads, int hd);
#endif

/* Dispatch: 0 scalar, 1 avx2, 2 avx512. */
enum { SI4_ISA_SCALAR = 0, SI4_ISA_AVX2 = 1, SI4_ISA_AVX512 = 2 };
int si4_best_isa(void);          /* the best path this CPU and build support */
si4_kernel_fn si4_kernel_for(int isa);
si4_prepare_fn si4_prepare_for(int isa);
si8_kernel_fn si8_kernel_for(int isa);
si4_attend_fn si4_attend_for(int isa);
si4_f16_store_fn si4_f16_store_for(int isa);
si4_q8_store_fn si4_q8_store_for(int isa);
si4_glu_fn si4_glu_for(int isa);
si4_dequant_fn si4_dequant_for(int isa);
const char *si4_isa_name(int isa);

/* Thread pool: run fn(arg, part, n_parts) for part = 0 .. n_parts - 1, part 0 on the caller.
 * A part whose worker has not started when the caller's part returns is skipped: fn must hand
 * out the work dynamically (each part takes pieces until none is left). */
typedef void (*si4_task_fn)(void *arg, int part, int n_parts);
int si4_pool_size(void);                 /* threads including the caller */
int si4_pool_resize(int n_threads);      /* 0 on success */
void si4_pool_set_spin_us(int us);
int si4_pool_spin_us(void);
void si4_pool_run(si4_task_fn fn, void *arg, int n_parts);
/* A thread's scratch: *p grown to at least `need` bytes, 64-byte aligned, its old contents not
 * kept (*have: its size); 0, or -1 out of memory (*p then NULL). */
int si4_reserve(void **p, size_t *have, size_t need);

#endif
