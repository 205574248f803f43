/* Quantized matrices in GGUF's own bytes, column-major, with int8 activations (see ../qlayout.py).
 *
 * A weight W (N out, K in) of a GGUF type is stored as unsigned codes q of `bits` bits with
 * factors per (group of `group` inputs, row):
 *
 *     w = D * q + M,    D = d * sc (sc: 1 when absent),
 *                       M = -dmin * mn (K-quants), m (Q4_1 / Q5_1), else -off * D
 *
 *   type   bits group  d per      m per     sc   mn   off      bytes / 32 weights (= file)
 *   Q4_0   4    32     group      -         -    -    8        18
 *   Q4_1   4    32     group      group     -    -    0        20
 *   Q5_0   5    32     group      -         -    -    16       22
 *   Q5_1   5    32     group      group     -    -    0        24
 *   Q8_0   8    32     group      -         -    -    0 (q is signed int8)   34
 *   Q4_K   4    32     256        256       6-bit sc, mn      0        18
 *   Q5_K   5    32     256        256       6-bit sc, mn      0        22
 *   Q6_K   6    16     256        -         i8   -    32       26.25
 *
 * Codes: column j is one run of colstride = npad * bits / 8 bytes (npad = N rounded up to
 * 32), in chunks of 32 rows, cb = 4 * bits bytes each. A chunk is laid out so that the AVX2
 * kernel's byte interleave of four columns yields rows in natural order (qlayout.py gives the
 * exact row of every nibble and bit); the portable kernel reads it through the same map.
 *
 * Activations: x is quantized per 32 inputs, as llama.cpp's Q8_0 does (dx = max |x| / 127,
 * qx = round(x / dx)), and the kept columns of each group are listed in slots padded to a
 * multiple of 4 (a pad slot repeats a kept column with qx = 0), so that the kernels multiply
 * four columns at a time:  y_n += D_ng * dx * sum_slots q_nj qx_j  +  M_ng * dx * sum_kept qx_j.
 */
#ifndef LLMLOCAL_QMAT_H
#define LLMLOCAL_QMAT_H

#include <stddef.h>
#include <stdint.h>

#include "sparse_int4.h"

enum { QM_Q4_0 = 2, QM_Q4_1 = 3, QM_Q5_0 = 6, QM_Q5_1 = 7, QM_Q8_0 = 8, QM_Q4_K = 12, QM_Q5_K = 13, QM_Q6_K = 14 };
#define QM_QBLOCK 32 /* inputs per activation scale */
/* Rows of x per call: prefill chunks run through the GEMV too, each weight byte read once per
 * QM_MAX_BATCH rows (DecodeStack's steps stay within SI4_MAX_BATCH). */
#define QM_MAX_BATCH 64

typedef struct {
    const uint8_t *codes;  /* (K, colstride) */
    const uint16_t *d;     /* (K / dgroup, npad) fp16 */
    const uint16_t *m;     /* (K / dgroup, npad) fp16, or NULL: Q4_1 / Q5_1 min, K-quant dmin */
    const uint8_t *sc;     /* (K / group, npad), or NULL: Q6_K's int8 sub-block scales; Q4_K / Q5_K's
                            * 6-bit scale, and the top 2 bits of the 6-bit min at bits 6, 7 */
    const uint32_t *mn;    /* (K / 256, npad), or NULL: Q4_K / Q5_K's low 4 bits of sub-block j's
                            * min at bits 4j (12 bytes per super-block and row in all, as in the
                            * file). Interleaved: d, m, sc, mn chunk by chunk (qm_fat). */
    int type, bits, group, dgroup, off, sc_signed;
    int interleaved; /* codes in quads of columns (dense only; see qlayout.py) */
    int n, npad, k;
    size_t colstride;
} qm_matrix;

/* Thresholded, compacted, quantized activations (built by qm_prepare). */
typedef struct {
    int batch, n_groups;
    int n_slots;          /* slots over all groups, each group's a multiple of 4 */
    const int32_t *cols;  /* (n_slots,) column of each slot */
    const int32_t *goff;  /* (n_groups + 1,) group g's slots: [goff[g], goff[g + 1]) */
    const int8_t *qx;     /* (batch, qx_stride) quantized value of row b in slot i; 0 in pads and zeroed columns */
    size_t qx_stride;
    const float *dx;      /* (batch, K / 32) scale of each row's block of 32 inputs */
    size_t dx_stride;
    const float *xs;      /* (n_groups, batch) dx * sum of each row's kept qx in group g */
} qm_acts;

/* Rows [row0, row1) (multiples of 32) over the groups [g0, g1), every batch row, into
 * ybuf[b * npad + n] (overwritten), as si4_kernel_fn. */
typedef void (*qm_kernel_fn)(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
void qm_kernel_scalar(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
#ifdef LLMLOCAL_X86_VARIANTS
void qm_kernel_avx2(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
void qm_kernel_avxvnni(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
void qm_kernel_avx512vnni(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
#ifdef LLMLOCAL_AMX
void qm_kernel_amx(const qm_matrix *m, const qm_acts *a, int row0, int row1, int g0, int g1, float *ybuf);
#endif
#endif
/* The kernel of an ISA path: on the AVX2 and AVX-512 paths the VNNI variant where the CPU has
 * one (AVX512-VNNI only on the AVX-512 path), unless `vnni` is 0; on the AVX-512 path with
 * `amx`, the one whose prefill uses AMX tiles where the CPU has them and the OS grants them.
 * Every variant gives the same floats (qmat_body.h). qm_kernel_name: "scalar", "avx2",
 * "avxvnni", "avx512vnni" or "avx512vnni-amx". */
qm_kernel_fn qm_kernel_for(int isa, int vnni, int amx);
const char *qm_kernel_name(qm_kernel_fn f);
/* The multiply-adds `iters` rounds of the named kernel's inner instruction sequence make
 * (bench_kernels.py times them); -1 for a kernel without one or that this CPU lacks. */
long long qm_mac_peak(const char *kernel, long long iters);
#ifdef LLMLOCAL_X86_VARIANTS
long long qm_mac_peak_avx2(long long iters);
long long qm_mac_peak_avxvnni(long long iters);
long long qm_mac_peak_avx512vnni(long long iters);
/* The multi-row path's passes alone (qmat_body.h): the avx2 and avx512vnni kernels'; -1 for
 * the others. */
long long qm_pass_peak(const char *kernel, long long iters);
long long qm_pass_peak_avx2(long long iters);
long long qm_pass_peak_avx512vnni(long long iters);
#endif

/* Thresholds, compacts and quantizes x; returns the columns kept (by any row). Buffers: cols
 * and qx rows k + 4 * n_groups slots, goff n_groups + 1, dx k / 32 per row, xs n_groups * batch,
 * row_counts batch (or NULL). `all_columns`: every column gets its slot (an interleaved matrix),
 * thresholded values are only zeroed. */
int qm_prepare(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int dense,
               int all_columns, int32_t *cols,
               int32_t *goff, int8_t *qx, size_t qx_stride, float *dx, size_t dx_stride, float *xs, int32_t *row_counts,
               int *n_slots);

/* Columns [j0, j1), rows [row0, row1) (multiples of 32) of the dequantized W, transposed:
 * out[(j - j0) * out_stride + n - row0] = W[n, j]. */
/* The dense case of qm_prepare (every column kept, slots = columns): qx, dx, xs only. */
typedef void (*qm_dense_prepare_fn)(const float *x, size_t x_stride, int batch, int k, int group, int8_t *qx,
                                    size_t qx_stride, float *dx, size_t dx_stride, float *xs);
void qm_dense_prepare_scalar(const float *x, size_t x_stride, int batch, int k, int group, int8_t *qx,
                             size_t qx_stride, float *dx, size_t dx_stride, float *xs);
#ifdef LLMLOCAL_X86_VARIANTS
void qm_dense_prepare_avx2(const float *x, size_t x_stride, int batch, int k, int group, int8_t *qx,
                           size_t qx_stride, float *dx, size_t dx_stride, float *xs);
#endif
qm_dense_prepare_fn qm_dense_prepare_for(int isa);
extern qm_dense_prepare_fn g_dense_prepare; /* the current ISA's, set with it */
/* The all-columns case with a threshold (values at or below it zeroed, every column its slot):
 * qx, dx, xs and row_counts as qm_prepare makes them; returns the columns some row keeps, -1
 * out of memory. g_zeroing_prepare: the current ISA's, or NULL (the loop in qm_prepare). */
typedef int (*qm_zeroing_prepare_fn)(const float *x, size_t x_stride, int batch, int k, int group, float threshold,
                                     int8_t *qx, size_t qx_stride, float *dx, size_t dx_stride, float *xs,
                                     int32_t *row_counts);
#ifdef LLMLOCAL_X86_VARIANTS
int qm_zeroing_prepare_avx2(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int8_t *qx,
                            size_t qx_stride, float *dx, size_t dx_stride, float *xs, int32_t *row_counts);
#endif
qm_zeroing_prepare_fn qm_zeroing_prepare_for(int isa);
extern qm_zeroing_prepare_fn g_zeroing_prepare;

/* qm_prepare's thresholded case for the column layout (all_columns 0, batch <= SI4_MAX_BATCH)
 * in a kernel's vector registers: the same outputs. g_sparse_prepare is the current kernel's
 * (qm_sparse_prepare_for), or NULL: the loop in qm_prepare. */
typedef int (*qm_sparse_prepare_fn)(const float *x, size_t x_stride, int batch, int k, int group, float threshold,
                                    int32_t *cols, int32_t *goff, int8_t *qx, size_t qx_stride, float *dx,
                                    size_t dx_stride, float *xs, int32_t *row_counts, int *n_slots);
#ifdef LLMLOCAL_X86_VARIANTS
int qm_sparse_prepare_avx512vnni(const float *x, size_t x_stride, int batch, int k, int group, float threshold,
                                 int32_t *cols, int32_t *goff, int8_t *qx, size_t qx_stride, float *dx, size_t dx_stride,
                                 float *xs, int32_t *row_counts, int *n_slots);
#ifdef LLMLOCAL_AMX
int qm_sparse_prepare_amx(const float *x, size_t x_stride, int batch, int k, int group, float threshold, int32_t *cols,
                          int32_t *goff, int8_t *qx, size_t qx_stride, float *dx, size_t dx_stride, float *xs,
                          int32_t *row_counts, int *n_slots);
#endif
#endif
qm_sparse_prepare_fn qm_sparse_prepare_for(qm_kernel_fn kernel);
extern qm_sparse_prepare_fn g_sparse_prepare;


/* Codes (n, k) uint8, row-major, into the interleaved layout (qlayout.pack); out holds
 * k / 4 * ceil(n / 32) * 16 * bits bytes. */
void qm_pack_interleaved(const uint8_t *codes, int n, int k, int bits, int group, uint8_t *out);

/* Codes of n rows of nb blocks of Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K (the file's bytes)
 * into out (n, values nb) uint8, as qlayout.decode; -1 for another type. qm_block_shape gives
 * a type's block bytes and values (0 for a type qm_decode_codes does not read). */
int qm_block_shape(int type, size_t *bytes, size_t *values);
int qm_decode_codes(const uint8_t *raw, size_t n, size_t nb, int type, uint8_t *out);

/* n rows of a GGUF tensor of any type above, row i's blocks at rows[i] (the file's bytes, in
 * any order: a row permutation or rows of several tensors cost nothing), straight into the
 * interleaved layout's arrays, as qlayout.pack(decode(...), interleaved=True) writes them:
 * codes as qm_pack_interleaved, d / m / sc / mn in qm_fat's order (NULL where the type has
 * none); rows past n zero. One pass, a chunk of 32 rows at a time (its codes decoded into a
 * 32 k-byte buffer that stays in cache). 0, or -1 for a type it does not read, -2 out of memory. */
int qm_pack_rows(int type, const uint8_t *const *rows, int n, int k, int bits, int group, int dgroup, uint8_t *codes,
                 uint16_t *d, uint16_t *m, uint8_t *sc, uint32_t *mn);

/* n rows of a GGUF tensor as qm_pack_rows reads them (any type it reads, Q8_0 too), each
 * dequantized and quantized again as Q4_0 blocks (18 bytes a 32 values: row r at out + r k / 32
 * * 18): a draft model's weights at 4.5 bits, whose numbers only propose. 0, or -1 for a type
 * it does not read or k not whole blocks. */
int qm_requant_q4_0(int type, const uint8_t *const *rows, int n, int k, uint8_t *out);

typedef void (*qm_dequant_fn)(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride);
void qm_dequant(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride);
#ifdef LLMLOCAL_X86_VARIANTS
void qm_dequant_avx2(const qm_matrix *m, int j0, int j1, int row0, int row1, float *out, size_t out_stride);
#endif
qm_dequant_fn qm_dequant_for(int isa);

#ifdef LLMLOCAL_AMX_BF16
/* Prompt rows through AMX-BF16 tiles (qmat_tiles.c): whether this CPU and OS allow them, and
 * y (batch, y_stride) = W x' for `batch` rows of x (x_stride), W dequantized and rounded to
 * bfloat16, x' (|x| <= threshold zeroed unless dense) rounded to bfloat16 into xb
 * ((batch rounded up to 16) x k values), sums in float32. Runs on the pool; returns the inputs
 * kept, or -1 when out of memory. */
int qm_tiles_usable(void);
void qm_group_codes_amx(const qm_matrix *m, int n, int g, uint8_t *out); /* qmat_body.h */
long qm_tiles_gemm(const qm_matrix *m, const float *x, size_t x_stride, int batch, float threshold,
                   int dense, float *y, size_t y_stride, uint16_t *xb);
/* A prompt chunk's causal attention through the same tiles (attn_tiles.c): q (T, H, D) at
 * positions start .. start + T - 1 over k, v (L = start + T, Hkv, D), strides in floats; a
 * token sees the last `window` positions (0: all). 0, -1 out of memory, -2 a shape it does
 * not take (D a multiple of 32 up to 256, H a multiple of Hkv). */
long qm_attn_tiles(const float *q, size_t qt, size_t qh, int T, int H, const float *k, const float *v, size_t kl,
                   size_t kh, int L, int Hkv, int D, int start, int window, float scale, float *out, size_t ot,
                   size_t oh);
#endif

/* qm_attn_tiles's contract in float32 on AVX2 and FMA (attn_fma.c): the same arguments, results
 * rounded only to float32. */
long qm_attn_fma(const float *q, size_t qt, size_t qh, int T, int H, const float *k, const float *v, size_t kl, size_t kh,
                 int L, int Hkv, int D, int start, int window, float scale, float *out, size_t ot, size_t oh);

#ifdef LLMLOCAL_AVX512_BF16
/* qm_attn_tiles on AVX512-BF16 without AMX (attn_bf16.c): the same arguments and results. */
long qm_attn_bf16(const float *q, size_t qt, size_t qh, int T, int H, const float *k, const float *v, size_t kl,
                  size_t kh, int L, int Hkv, int D, int start, int window, float scale, float *out, size_t ot,
                  size_t oh);
#endif

/* Code of row n, column j (see qlayout.py for the map), as the unsigned q (Q8_0: the signed
 * value). */
int qm_code(const qm_matrix *m, int j, int n);

/* The interleaved layout's tile (chunk c of 32 rows, group g): the group's quads of those rows.
 * Tiles are in the order (chunk, group): a chunk's codes over every group are one run. */
static inline const uint8_t *qm_tile(const qm_matrix *m, int c, int g) {
    return m->codes + ((size_t)c * (size_t)(m->k / m->group) + (size_t)g) * (size_t)(m->group / 4) * (size_t)(16 * m->bits);
}

/* Where row n's factor of group (or super-block) f lives in d, m, sc or mn, arrays of nf
 * factors a row: (nf, npad) in the column layout; in the interleaved one (npad / 32, nf, 32),
 * so that a chunk's factors over all of K are one run, as its codes are. */
static inline size_t qm_fat(const qm_matrix *m, size_t f, size_t nf, int n) {
    return m->interleaved ? ((size_t)(n / 32) * nf + f) * 32 + (size_t)(n % 32) : f * (size_t)m->npad + (size_t)n;
}

/* A group's slots [first, n) padded to a multiple of 4 (the kernels take four columns at a time):
 * a pad slot repeats a kept column with qx = 0 in every row. Returns the new end. */
static inline int qm_pad_slots(int32_t *cols, int8_t *qx, size_t qx_stride, int batch, int first, int n) {
    for (; (n - first) % 4; n++) {
        cols[n] = cols[n - 1];
        for (int b = 0; b < batch; b++) qx[(size_t)b * qx_stride + n] = 0;
    }
    return n;
}

/* fp16 bits -> float, portable. */
static inline float qm_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, f = h & 1023;
    union { uint32_t u; float f; } v;
    if (e == 0) { /* zero or subnormal: f * 2^-24 */
        v.f = (float)f * 5.9604644775390625e-8f;
        v.u |= sign;
        return v.f;
    }
    v.u = sign | (e == 31 ? 0x7f800000u | (f << 13) : ((e + 112) << 23) | (f << 13));
    return v.f;
}

/* The factors of row n in group g: w = D * q + M (the kernels compute them in this order). */
static inline void qm_factors(const qm_matrix *m, int g, int n, float *D, float *M) {
    const size_t dg = (size_t)g * m->group / m->dgroup, nd = (size_t)(m->k / m->dgroup);
    const size_t at = qm_fat(m, (size_t)g, (size_t)(m->k / m->group), n), dat = qm_fat(m, dg, nd, n);
    float d = qm_f16(m->d[dat]);
    int sc = 0, mn = 0;
    if (m->mn) { /* 6-bit scale and min of sub-block g % 8 */
        sc = m->sc[at] & 63;
        mn = (m->sc[at] >> 6) << 4 | (int)((m->mn[dat] >> (4 * (g % 8))) & 15);
    } else if (m->sc) {
        sc = m->sc_signed ? (int8_t)m->sc[at] : m->sc[at];
    }
    if (m->sc) d *= (float)sc;
    *D = d;
    if (m->mn) *M = -(qm_f16(m->m[dat]) * (float)mn);
    else if (m->m) *M = qm_f16(m->m[dat]);
    else *M = (float)-m->off * d;
}

#endif
