/* Prompt rows through AMX-BF16 tile multiplies (Sapphire Rapids and later): y = W x'^T with
 * the weight dequantized to bfloat16 and the activations rounded to bfloat16, products summed in
 * float32 by the tiles.
 *
 * Why: the int8 kernels (qmat_body.h) scale every group of 32 inputs by its own factors, so
 * prefill spends about half its time in those float updates, whatever does the multiplies.
 * Here the factors are applied once, when a block of W is dequantized, and the tile multiplies
 * then run over all of K with nothing between them; the dequantization is shared by every row
 * of the call. bfloat16 keeps 8 significant bits against int8's 7 per 32 inputs, relative to
 * each value instead of to its block's largest: a product errs about 3-4x less than with int8
 * activations (docs/performance.md), though W itself is rounded too.
 *
 * Layout: a chunk of 32 rows of W is dequantized, group by group from the codes the int8 AMX
 * path unpacks (qm_group_codes_amx), into a panel of bfloat16 B tiles: per step s of 32 inputs and half h (16 rows), 16
 * tile rows of 64 bytes, row p holding inputs 2p and 2p + 1 of each of the 16 rows of W
 * interleaved, the pair layout tdpbf16ps wants. x is rounded once per call into rows of K
 * bfloat16, padded with zero rows to a multiple of 16. Each 32 rows of x against a chunk make
 * four C tiles (two A tiles, two B tiles): every output is one tile element's sum over all of
 * K in the same order, so a row's result does not depend on the other rows of the call, nor
 * on how many threads share the work (threads take blocks of W's rows).
 *
 * Compiled with -mamx-tile -mamx-bf16 -mavx512bf16 -mavx512bw (setup.py, LLMLOCAL_AMX_BF16). */
#define _GNU_SOURCE /* syscall() */
#include <cpuid.h>
#include <immintrin.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "qmat.h"

#define PANEL_BUDGET (1 << 19) /* bytes of bfloat16 panels a block of W's rows may take over a block of K */
#define MAX_CHUNKS 4           /* chunks of 32 rows per block */
#define MAX_KBLOCK 2048        /* inputs per block of K */

int qm_tiles_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d, a1, b1, c1, d1;
        usable = 0;
        __builtin_cpu_init();
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24)) && /* AMX-BF16, AMX-TILE */
            __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 & (1u << 5)) &&                     /* AVX512-BF16 */
            __builtin_cpu_supports("avx512bw"))
            usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return usable;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-3 C (16 x 16 float32), 4-5 A (16 rows of x by 32 inputs), 6-7 B (16 pairs of inputs by
 * 16 rows of W): every tile 16 rows of 64 bytes. */
static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* The factors of rows [n, n + 16) in group g (w = D q + M), as qm_factors computes them. */
static void factors16(const qm_matrix *m, int g, int n, __m512 *D, __m512 *M) {
    const size_t dg = (size_t)g * m->group / m->dgroup, nd = (size_t)(m->k / m->dgroup);
    const size_t at = qm_fat(m, (size_t)g, (size_t)(m->k / m->group), n), dat = qm_fat(m, dg, nd, n);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m->d + dat)));
    if (m->mn) { /* Q4_K / Q5_K: 6-bit scale and min of sub-block g % 8 */
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(m->sc + at)));
        const __m512i lo = _mm512_srli_epi32(_mm512_loadu_si512(m->mn + dat), 4 * (g % 8));
        const __m512i sc = _mm512_and_si512(b, _mm512_set1_epi32(63));
        const __m512i mn = _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(b, 6), 4), _mm512_and_si512(lo, _mm512_set1_epi32(15)));
        *D = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m->m + dat)));
        *M = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
        return;
    }
    if (m->sc) {
        const __m128i s = _mm_loadu_si128((const __m128i *)(m->sc + at));
        d = _mm512_mul_ps(d, _mm512_cvtepi32_ps(m->sc_signed ? _mm512_cvtepi8_epi32(s) : _mm512_cvtepu8_epi32(s)));
    }
    *D = d;
    if (m->m) *M = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m->m + dat)));
    else *M = _mm512_mul_ps(_mm512_set1_ps((float)-m->off), d);
}

/* Steps [s0, s1) (inputs 32 s0 .. 32 s1) of chunk `row` (32 rows of W) into its panel: per step
 * 2 halves x 16 x 32 bfloat16, pair row p of a step holding inputs 2p and 2p + 1 of each of the
 * half's 16 rows, interleaved. */
static void dequant_panel(const qm_matrix *m, int row, int s0, int s1, uint16_t *panel) {
    static const uint32_t lo_rows[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
    static const uint32_t hi_rows[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
    const __m512i plo = _mm512_loadu_si512(lo_rows), phi = _mm512_loadu_si512(hi_rows);
    const int group = m->group, sgn = m->bits == 8;
    uint8_t codes[8 * 64] __attribute__((aligned(64)));
    for (int h = 0; h < 2; h++) {
        const int n = row + 16 * h;
        for (int g = 32 * s0 / group; g < 32 * s1 / group; g++) {
            __m512 D, M;
            factors16(m, g, n, &D, &M);
            qm_group_codes_amx(m, n, g, codes);
            /* lanes 2r + t: row r (of 8), input t of the pair */
            const __m512 dl = _mm512_permutexvar_ps(plo, D), dh = _mm512_permutexvar_ps(phi, D);
            const __m512 ml = _mm512_permutexvar_ps(plo, M), mh = _mm512_permutexvar_ps(phi, M);
            const int j0 = g * group; /* the group's first input */
            uint16_t *dst = panel + ((size_t)(j0 / 32 - s0) * 2 + (size_t)h) * 16 * 32 + (size_t)(j0 % 32) / 2 * 32;
            for (int p = 0; p < group / 2; p++) {
                __m512i v = _mm512_load_si512(codes + 64 * (p / 2)); /* int32 lane r: inputs 4i .. 4i + 3 of row r */
                if (p % 2) v = _mm512_srli_epi32(v, 16);
                const __m256i pairs = _mm512_cvtepi32_epi16(v); /* bytes 2r, 2r + 1: the pair of row r */
                const __m128i a = _mm256_castsi256_si128(pairs), b = _mm256_extracti128_si256(pairs, 1);
                const __m512i qa = sgn ? _mm512_cvtepi8_epi32(a) : _mm512_cvtepu8_epi32(a);
                const __m512i qb = sgn ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
                const __m512 wa = _mm512_fmadd_ps(dl, _mm512_cvtepi32_ps(qa), ml);
                const __m512 wb = _mm512_fmadd_ps(dh, _mm512_cvtepi32_ps(qb), mh);
                _mm512_store_si512(dst + (size_t)p * 32, (__m512i)_mm512_cvtne2ps_pbh(wb, wa));
            }
        }
    }
}

/* 16 rows of C at `c` (float32, 16 values each) into y rows [b, b + 16) below `batch`, columns
 * [n, n + 16) below `ncols`. */
static void put(const float *c, float *y, size_t y_stride, int b, int batch, int n, int ncols) {
    const int rows = batch - b < 16 ? batch - b : 16, cols = ncols - n < 16 ? ncols - n : 16;
    if (cols <= 0) return;
    const __mmask16 keep = (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + (size_t)(b + r) * y_stride + n, keep, _mm512_load_ps(c + 16 * r));
}

/* C tile t: zeroed (the first steps of K), or loaded from a thread's sums (`acc`). */
#define C_START(t, acc, first, stride)                                                              \
    do {                                                                                          \
        if (first) _tile_zero(t);                                                                 \
        else _tile_loadd(t, acc, stride);                                                         \
    } while (0)
/* ... and at the end of the block: into y (the last steps of K) or back into the sums. */
#define C_END(t, acc, last, stride, b, n)                                                           \
    do {                                                                                          \
        if (last) {                                                                               \
            _tile_stored(t, ct, 64);                                                              \
            put(ct, y, y_stride, b, batch, n, ncols);                                             \
        } else {                                                                                  \
            _tile_stored(t, acc, stride);                                                         \
        }                                                                                         \
    } while (0)

/* 32 rows of x (or 16: `pair` 0) from row b against `steps` steps of the panel of the chunk at W
 * row n, from the step whose inputs start at x column `x0`. Sums start at zero (`first`) or
 * from `acc` (this thread's (rows, 32) float32 sums of the chunk, row stride acc_stride floats)
 * and end in y (`last`) or back in `acc`: the same sums, in the same order, as one pass over K. */
static void tiles_32(const uint16_t *xb, size_t k, size_t x0, const uint16_t *panel, int steps, int b, int pair,
                     float *acc, size_t acc_stride, int first, int last, float *ct, float *y, size_t y_stride, int batch,
                     int n, int ncols) {
    const uint16_t *a0 = xb + (size_t)b * k + x0, *a1 = a0 + 16 * k;
    const long as = (long)(2 * k), cs = (long)(4 * acc_stride);
#define acc1 (acc + 16 * acc_stride) /* rows b + 16 .. of the sums (evaluated only where used) */
    C_START(0, acc, first, cs);
    C_START(1, acc + 16, first, cs);
    if (pair) {
        C_START(2, acc1, first, cs);
        C_START(3, acc1 + 16, first, cs);
    }
    for (int s = 0; s < steps; s++) { /* `pair` is the same throughout: the compiler unswitches it */
        const uint16_t *p = panel + (size_t)s * 2 * 16 * 32;
        _tile_loadd(6, p, 64);
        _tile_loadd(7, p + 16 * 32, 64);
        _tile_loadd(4, a0 + 32 * s, as);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (pair) {
            _tile_loadd(5, a1 + 32 * s, as);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    C_END(0, acc, last, cs, b, n);
    C_END(1, acc + 16, last, cs, b, n + 16);
    if (pair) {
        C_END(2, acc1, last, cs, b + 16, n);
        C_END(3, acc1 + 16, last, cs, b + 16, n + 16);
    }
#undef acc1
}

typedef struct {
    const qm_matrix *m;
    const uint16_t *xb; /* (batch rounded up to 16, k) */
    int batch, chunks_per_block, n_blocks, steps_per_kblock;
    float *y;
    size_t y_stride;
    atomic_int next;
} tiles_job;

static _Thread_local uint16_t *t_panels; /* a block's panels over one block of K */
static _Thread_local float *t_acc;       /* its sums between blocks of K */
static _Thread_local size_t t_panels_n, t_acc_n;

/* Blocks of chunks_per_block chunks of W's rows, taken in turn: for each block of K (all of K
 * when it is short), the block's panels over it are dequantized, then every 32 rows of x run
 * against them. x is read once per block of W's rows and K: a long K (the MLP's down
 * projection) in blocks keeps a block's panels and the rows of x it meets in L2. */
static void run_tiles(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    tiles_job *j = arg;
    const qm_matrix *m = j->m;
    const int S = m->k / 32, SK = j->steps_per_kblock, per = j->chunks_per_block;
    const size_t panel = (size_t)SK * 2 * 16 * 32; /* bfloat16 values per chunk and block of K */
    const int chunks = m->npad / 32, bpad = (j->batch + 15) / 16 * 16;
    const size_t acc_stride = (size_t)per * 32;
    if (si4_reserve((void **)&t_panels, &t_panels_n, panel * (size_t)per * 2) ||
        (SK < S && si4_reserve((void **)&t_acc, &t_acc_n, (size_t)bpad * acc_stride * 4)))
        return; /* the other threads take its blocks */
    float ct[16 * 16] __attribute__((aligned(64)));
    float *y = j->y;
    const size_t y_stride = j->y_stride;
    const int batch = j->batch, ncols = m->n;
    configure();
    for (int blk; (blk = atomic_fetch_add(&j->next, 1)) < j->n_blocks;) {
        const int c0 = blk * per, c1 = c0 + per < chunks ? c0 + per : chunks;
        for (int s0 = 0; s0 < S; s0 += SK) {
            const int s1 = s0 + SK < S ? s0 + SK : S;
            for (int c = c0; c < c1; c++) dequant_panel(m, 32 * c, s0, s1, t_panels + (size_t)(c - c0) * panel);
            for (int b = 0; b < bpad; b += 32)
                for (int c = c0; c < c1; c++) {
                    float *acc = SK < S ? t_acc + (size_t)b * acc_stride + (size_t)(c - c0) * 32 : ct; /* ct: unused */
                    tiles_32(j->xb, (size_t)m->k, (size_t)s0 * 32, t_panels + (size_t)(c - c0) * panel, s1 - s0, b,
                             bpad - b >= 32, acc, acc_stride, s0 == 0, s1 == S, ct, y, y_stride, batch, 32 * c, ncols);
                }
        }
    }
    _tile_release();
}

/* x (batch, x_stride) float32 -> xb (batch rounded up to 16, k) bfloat16, |x| <= threshold
 * zeroed unless dense; returns the inputs kept. */
static long round_rows(const float *x, size_t x_stride, int batch, int k, float threshold, int dense, uint16_t *xb) {
    const int bpad = (batch + 15) / 16 * 16;
    const __m512 t = _mm512_set1_ps(threshold);
    long kept = 0;
    for (int b = 0; b < batch; b++) {
        const float *row = x + (size_t)b * x_stride;
        uint16_t *out = xb + (size_t)b * k;
        for (int j = 0; j < k; j += 32) { /* k is a multiple of 32 */
            __m512 lo = _mm512_loadu_ps(row + j), hi = _mm512_loadu_ps(row + j + 16);
            if (!dense) {
                const __mmask16 klo = _mm512_cmp_ps_mask(_mm512_abs_ps(lo), t, _CMP_GT_OQ);
                const __mmask16 khi = _mm512_cmp_ps_mask(_mm512_abs_ps(hi), t, _CMP_GT_OQ);
                lo = _mm512_maskz_mov_ps(klo, lo);
                hi = _mm512_maskz_mov_ps(khi, hi);
                kept += __builtin_popcount(klo) + __builtin_popcount(khi);
            }
            _mm512_storeu_si512(out + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
    memset(xb + (size_t)batch * k, 0, (size_t)(bpad - batch) * (size_t)k * 2);
    return dense ? (long)batch * k : kept;
}

long qm_tiles_gemm(const qm_matrix *m, const float *x, size_t x_stride, int batch, float threshold,
                   int dense, float *y, size_t y_stride, uint16_t *xb) {
    const long kept = round_rows(x, x_stride, batch, m->k, threshold, dense, xb);
    /* K in blocks of at most MAX_KBLOCK inputs, as even as they go; as many chunks a block of
     * W's rows as PANEL_BUDGET holds over one (up to MAX_CHUNKS) */
    const int S = m->k / 32, nk = (S + MAX_KBLOCK / 32 - 1) / (MAX_KBLOCK / 32), SK = (S + nk - 1) / nk;
    int per = (int)(PANEL_BUDGET / ((size_t)SK * 32 * 64));
    per = per < 1 ? 1 : per > MAX_CHUNKS ? MAX_CHUNKS : per;
    const int chunks = m->npad / 32;
    tiles_job job = {.m = m, .xb = xb, .batch = batch, .chunks_per_block = per, .n_blocks = (chunks + per - 1) / per,
                     .steps_per_kblock = SK, .y = y, .y_stride = y_stride};
    atomic_init(&job.next, 0);
    si4_pool_run(run_tiles, &job, si4_pool_size());
    /* a thread without its buffers takes no block: some block left means none could */
    return atomic_load(&job.next) < job.n_blocks ? -1 : kept;
}
