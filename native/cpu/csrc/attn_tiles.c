/* A prompt chunk's causal attention through AMX-BF16 tiles (Sapphire Rapids and later).
 *
 * Why: with the projections on tiles (qmat_tiles.c), attention in float32 was a third of a
 * 4,000-token prompt's prefill. Here a tile of 16 query rows of one head meets the keys in
 * blocks: S = Q K^T by tdpbf16ps (Q scaled, then rounded to bfloat16; K rounded), an exact
 * softmax per row in float32 over its own keys (its maximum, exp, their sum), P rounded to
 * bfloat16, and O = P V by tdpbf16ps, divided by the sum at the end.
 *
 * A row's result depends on its own query, position and keys only, never on the call's shape:
 * key blocks start at multiples of 32 from position 0 whatever the chunk; a key a row may not
 * see (after it, or before its window) is given P = 0 exactly, so the blocks a tile computes
 * for its other rows add nothing to it; every sum runs in one order. So a prompt's reply is the
 * same computed in one chunk, in several, or resumed from the cache (the engine reads K and V
 * as the cache holds them for every chunk).
 *
 * Layouts (bfloat16): K per kv head in blocks of 16 keys by 32 dims, a B tile each (row r:
 * dims 2r, 2r + 1 of each key, interleaved); V per kv head in blocks of 32 keys by 16 dims
 * (row r: keys 2r, 2r + 1 of each dim); a tile's P rows are A tiles of 32 keys as they lie.
 *
 * Compiled with -mamx-tile -mamx-bf16 -mavx512bf16 -mavx512f -mavx512bw -mavx512dq (setup.py,
 * LLMLOCAL_AMX_BF16) as qm_attn_tiles, and without AMX as qm_attn_bf16 (attn_bf16.c: CPUs with
 * AVX512-BF16 and no tiles, Zen 4 and 5), the products then made by vdpbf16ps from the same layouts. */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qmat.h"
#include "vexp.h"

#ifndef ATTN_ENTRY
#define ATTN_ENTRY qm_attn_tiles
#endif

#ifdef __AMX_TILE__
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(void) { /* every tile 16 rows of 64 bytes */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}
#else
/* Without AMX the two products are made by vdpbf16ps straight from the layouts (qk_pair, pv_rows
 * below) with the tile multiply's arithmetic: C[i][n] += A[i][2r] B[r][2n] + A[i][2r + 1]
 * B[r][2n + 1] for r = 0 .. 15, the pair of A's row i broadcast against row r of B, float32
 * sums, each element's chain over the tiles and r in the order the tile code takes them. An
 * emulation of the tile registers in memory, one tile multiply at a time, broadcast A's pair
 * once per 16 products and waited on the instruction's latency: one A pair now feeds both key
 * blocks (S) or four 16-dim tiles (O), 8 or 4 rows' chains interleaved. */
static void configure(void) {}
static void release_tiles(void) {}
#undef _tile_release
#define _tile_release() release_tiles()

/* The two 16-key blocks of S at k0, k1 (their D / 32 B tiles each) for the query rows
 * [0, rows) of qa (A tiles: rows of D values): s0, s1 rows of ncol floats. */
static void qk_pair(const uint16_t *qa, int D, int rows, const uint16_t *k0, const uint16_t *k1, float *s0, float *s1,
                    int ncol) {
    for (int i0 = 0; i0 < rows; i0 += 8) {
        __m512 a[8], b[8];
        for (int i = 0; i < 8; i++) a[i] = b[i] = _mm512_setzero_ps();
        for (int c = 0; c < D / 32; c++) {
            const uint32_t *q = (const uint32_t *)(qa + (size_t)i0 * D + 32 * c); /* row i's pairs at q + i D / 2 */
            for (int r = 0; r < 16; r++) {
                const __m512bh w0 = (__m512bh)_mm512_load_si512(k0 + (size_t)c * 512 + 32 * r);
                const __m512bh w1 = (__m512bh)_mm512_load_si512(k1 + (size_t)c * 512 + 32 * r);
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++) {
                    const __m512bh x = (__m512bh)_mm512_set1_epi32((int)q[(size_t)i * (D / 2) + r]);
                    a[i] = _mm512_dpbf16_ps(a[i], x, w0);
                    b[i] = _mm512_dpbf16_ps(b[i], x, w1);
                }
            }
        }
        for (int i = 0; i < 8; i++) {
            _mm512_storeu_ps(s0 + (size_t)(i0 + i) * ncol, a[i]);
            _mm512_storeu_ps(s1 + (size_t)(i0 + i) * ncol, b[i]);
        }
    }
}

/* O = P V for the rows [0, rows): P's blocks of 32 keys (A tiles, rows of ncol values) against
 * V's tiles of blocks vb0 .. vb0 + nvb - 1 (vt: the first's, de tiles of 16 dims a block), each
 * output row scaled by inv[i] into out + i * ostride. */
static void pv_rows(const uint16_t *P, int ncol, const uint16_t *vt, int nvb, int de, int rows, const float *inv,
                    float *out, size_t ostride) {
    for (int i0 = 0; i0 < rows; i0 += 4)
        for (int e0 = 0; e0 < de; e0 += 4) {
            const int ne = de - e0 < 4 ? de - e0 : 4;
            __m512 o[4][4];
            for (int i = 0; i < 4; i++)
                for (int e = 0; e < 4; e++) o[i][e] = _mm512_setzero_ps();
            for (int vb = 0; vb < nvb; vb++) {
                const uint32_t *p = (const uint32_t *)(P + (size_t)i0 * ncol + 32 * vb); /* row i's pairs at p + i ncol / 2 */
                const uint16_t *v = vt + ((size_t)vb * de + e0) * 512;
                for (int r = 0; r < 16; r++) {
                    __m512bh w[4];
                    for (int e = 0; e < 4; e++)
                        w[e] = (__m512bh)(e < ne ? _mm512_load_si512(v + (size_t)e * 512 + 32 * r) : _mm512_setzero_si512());
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++) {
                        const __m512bh x = (__m512bh)_mm512_set1_epi32((int)p[(size_t)i * (ncol / 2) + r]);
#pragma GCC unroll 4
                        for (int e = 0; e < 4; e++) o[i][e] = _mm512_dpbf16_ps(o[i][e], x, w[e]);
                    }
                }
            }
            for (int i = 0; i < 4 && i0 + i < rows; i++)
                for (int e = 0; e < ne; e++)
                    _mm512_storeu_ps(out + (size_t)(i0 + i) * ostride + 16 * (e0 + e), _mm512_mul_ps(o[i][e], _mm512_set1_ps(inv[i0 + i])));
        }
}
#endif

/* 16 floats -> bfloat16, round to nearest even (as vcvtne2ps2bf16). */
static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

typedef struct {
    const float *q, *k, *v;
    float *out;
    size_t qt, qh, kl, kh, ot, oh; /* strides in floats: q / out per token and head, k / v per key and head */
    int T, H, L, Hkv, D, start, window;
    float scale;
    int kb16, vb32; /* blocks of 16 keys (K) and of 32 keys (V) over L */
    uint16_t *kp, *vp; /* packed K and V, per kv head */
    atomic_int packed, next;
} attn_job;

/* K and V of kv head g into their tile layouts. */
static void pack_head(const attn_job *j, int g) {
    const int D = j->D, dc = D / 32;
    uint16_t *kp = j->kp + (size_t)g * j->kb16 * 16 * D, *vp = j->vp + (size_t)g * j->vb32 * 32 * D;
    for (int kb = 0; kb < j->kb16; kb++)
        for (int c = 0; c < dc; c++) {
            uint16_t *t = kp + ((size_t)kb * dc + c) * 512; /* 16 rows x 32 values */
            for (int n = 0; n < 16; n++) {
                const int key = 16 * kb + n;
                /* the key's 32 dims in bfloat16: the pair (2r, 2r + 1) goes to row r, column 2n */
                __m256i row = _mm256_setzero_si256();
                if (key < j->L) row = to_bf16(_mm512_loadu_ps(j->k + (size_t)key * j->kl + (size_t)g * j->kh + 32 * c));
                uint32_t pairs[8];
                _mm256_storeu_si256((__m256i *)pairs, row);
                for (int r = 0; r < 8; r++) memcpy(t + (size_t)r * 32 + 2 * n, &pairs[r], 4);
                __m256i row2 = _mm256_setzero_si256();
                if (key < j->L) row2 = to_bf16(_mm512_loadu_ps(j->k + (size_t)key * j->kl + (size_t)g * j->kh + 32 * c + 16));
                _mm256_storeu_si256((__m256i *)pairs, row2);
                for (int r = 0; r < 8; r++) memcpy(t + (size_t)(r + 8) * 32 + 2 * n, &pairs[r], 4);
            }
        }
    const int de = D / 16;
    uint16_t zero[16] = {0};
    for (int vb = 0; vb < j->vb32; vb++)
        for (int r = 0; r < 16; r++) {
            const int k0 = 32 * vb + 2 * r, k1 = k0 + 1;
            for (int e = 0; e < de; e++) {
                uint16_t a[16], b[16];
                if (k0 < j->L) _mm256_storeu_si256((__m256i *)a, to_bf16(_mm512_loadu_ps(j->v + (size_t)k0 * j->kl + (size_t)g * j->kh + 16 * e)));
                else memcpy(a, zero, sizeof a);
                if (k1 < j->L) _mm256_storeu_si256((__m256i *)b, to_bf16(_mm512_loadu_ps(j->v + (size_t)k1 * j->kl + (size_t)g * j->kh + 16 * e)));
                else memcpy(b, zero, sizeof b);
                uint16_t *t = vp + ((size_t)vb * de + e) * 512 + (size_t)r * 32;
                for (int n = 0; n < 16; n++) t[2 * n] = a[n], t[2 * n + 1] = b[n];
            }
        }
}

/* kv heads handed out in turn (the pool skips a part whose thread has not started) */
static void run_pack(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    attn_job *j = arg;
    for (int g; (g = atomic_fetch_add(&j->packed, 1)) < j->Hkv;) pack_head(j, g);
}

static _Thread_local float *t_s;
static _Thread_local uint16_t *t_p;
static _Thread_local size_t t_s_n, t_p_n;

/* Which of columns c .. c + 15 lie in [a, b). */
static inline __mmask16 keys_in(int c, int a, int b) {
    if (c >= a && c + 16 <= b) return 0xffff;
    const __m512i col = _mm512_add_epi32(_mm512_set1_epi32(c), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_cmpge_epi32_mask(col, _mm512_set1_epi32(a)) & _mm512_cmplt_epi32_mask(col, _mm512_set1_epi32(b));
}

/* Query rows [t0, t0 + rows) of head h. */
static void tile_rows(const attn_job *j, int h, int t0, int rows, float *S, uint16_t *P) {
    const int D = j->D, dc = D / 32, de = D / 16, g = h / (j->H / j->Hkv);
    const int p0 = j->start + t0, p1 = p0 + rows - 1; /* the tile's first and last positions */
    const int lo = j->window > 0 && p0 - j->window + 1 > 0 ? p0 - j->window + 1 : 0;
    const int vb0 = lo / 32, vb1 = p1 / 32 + 1, ncol = 32 * (vb1 - vb0); /* blocks of 32 keys */
    const uint16_t *kp = j->kp + (size_t)g * j->kb16 * 16 * D, *vp = j->vp + (size_t)g * j->vb32 * 32 * D;
    /* Q, scaled and rounded, as A tiles: 16 rows of D values (rows past `rows` zero) */
    uint16_t qa[16 * 256] __attribute__((aligned(64)));
    for (int i = 0; i < 16; i++)
        for (int d = 0; d < D; d += 16) {
            const __m512 x = i < rows ? _mm512_mul_ps(_mm512_loadu_ps(j->q + (size_t)(t0 + i) * j->qt + (size_t)h * j->qh + d),
                                                      _mm512_set1_ps(j->scale))
                                      : _mm512_setzero_ps();
            _mm256_storeu_si256((__m256i *)(qa + (size_t)i * D + d), to_bf16(x));
        }
#ifdef __AMX_TILE__
    /* S = Q K^T, two C tiles of 16 keys at a time (two chains of tile multiplies in flight);
     * Q's A tiles stay in tmm2-5 where D <= 128 */
    const int resident = dc <= 4;
    if (resident) {
        _tile_loadd(2, qa, 2 * D);
        if (dc > 1) _tile_loadd(3, qa + 32, 2 * D);
        if (dc > 2) _tile_loadd(4, qa + 64, 2 * D);
        if (dc > 3) _tile_loadd(5, qa + 96, 2 * D);
    }
    for (int kb = 2 * vb0; kb < 2 * vb1; kb += 2) {
        const uint16_t *k0 = kp + (size_t)kb * dc * 512, *k1 = k0 + (size_t)dc * 512;
        _tile_zero(0);
        _tile_zero(1);
#define QK(c, A)                                                                                  \
    do {                                                                                          \
        _tile_loadd(6, k0 + (c) * 512, 64);                                                       \
        _tile_loadd(7, k1 + (c) * 512, 64);                                                       \
        _tile_dpbf16ps(0, A, 6);                                                                  \
        _tile_dpbf16ps(1, A, 7);                                                                  \
    } while (0)
        if (resident) {
            QK(0, 2);
            if (dc > 1) QK(1, 3);
            if (dc > 2) QK(2, 4);
            if (dc > 3) QK(3, 5);
        } else {
            for (int c = 0; c < dc; c++) {
                _tile_loadd(2, qa + 32 * c, 2 * D);
                QK(c, 2);
            }
        }
#undef QK
        _tile_stored(0, S + 16 * (kb - 2 * vb0), 4 * ncol);
        _tile_stored(1, S + 16 * (kb + 1 - 2 * vb0), 4 * ncol);
    }
#else
    for (int kb = 2 * vb0; kb < 2 * vb1; kb += 2) {
        const uint16_t *k0 = kp + (size_t)kb * dc * 512;
        qk_pair(qa, D, rows, k0, k0 + (size_t)dc * 512, S + 16 * (kb - 2 * vb0), S + 16 * (kb + 1 - 2 * vb0), ncol);
    }
#endif
    /* each row's softmax over its own keys: P in bfloat16, its sum */
    float inv[16];
    for (int i = 0; i < 16; i++) {
        float *s = S + (size_t)i * ncol;
        uint16_t *p = P + (size_t)i * ncol;
        if (i >= rows) {
            memset(p, 0, (size_t)ncol * 2);
            continue;
        }
        const int pos = p0 + i, first = j->window > 0 && pos - j->window + 1 > 0 ? pos - j->window + 1 : 0;
        const int a = first - 32 * vb0, b = pos + 1 - 32 * vb0; /* its keys: columns [a, b) */
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (int c = 0; c < ncol; c += 16)
            mv = _mm512_mask_max_ps(mv, keys_in(c, a, b), mv, _mm512_loadu_ps(s + c));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
        __m512 lv = _mm512_setzero_ps();
        for (int c = 0; c < ncol; c += 16) {
            const __m512 e = _mm512_maskz_mov_ps(keys_in(c, a, b), exp_neg512(_mm512_sub_ps(_mm512_loadu_ps(s + c), m)));
            const __m256i eb = to_bf16(e);
            _mm256_storeu_si256((__m256i *)(p + c), eb);
            lv = _mm512_add_ps(lv, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16))); /* the rounded P */
        }
        inv[i] = 1.0f / _mm512_reduce_add_ps(lv);
    }
#ifdef __AMX_TILE__
    /* O = P V: 4 C tiles (64 dims) at a time, every block of 32 keys */
    float o[16 * 64] __attribute__((aligned(64)));
    for (int e0 = 0; e0 < de; e0 += 4) {
        const int ne = de - e0 < 4 ? de - e0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int vb = vb0; vb < vb1; vb++) {
            _tile_loadd(4, P + 32 * (vb - vb0), 2 * ncol);
            const uint16_t *vt = vp + ((size_t)vb * de + e0) * 512;
            _tile_loadd(5, vt, 64);
            _tile_dpbf16ps(0, 4, 5);
            if (ne > 1) {
                _tile_loadd(6, vt + 512, 64);
                _tile_dpbf16ps(1, 4, 6);
            }
            if (ne > 2) {
                _tile_loadd(7, vt + 1024, 64);
                _tile_dpbf16ps(2, 4, 7);
            }
            if (ne > 3) {
                _tile_loadd(5, vt + 1536, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, o, 256);
        _tile_stored(1, o + 16, 256);
        _tile_stored(2, o + 32, 256);
        _tile_stored(3, o + 48, 256);
        for (int i = 0; i < rows; i++) {
            float *dst = j->out + (size_t)(t0 + i) * j->ot + (size_t)h * j->oh + 16 * e0;
            for (int e = 0; e < ne; e++)
                _mm512_storeu_ps(dst + 16 * e, _mm512_mul_ps(_mm512_load_ps(o + (size_t)i * 64 + 16 * e), _mm512_set1_ps(inv[i])));
        }
    }
#else
    pv_rows(P, ncol, vp + (size_t)vb0 * de * 512, vb1 - vb0, de, rows, inv, j->out + (size_t)t0 * j->ot + (size_t)h * j->oh, j->ot);
#endif
}

static void run_attn(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    attn_job *j = arg;
    const int tiles = (j->T + 15) / 16, ncol_max = 32 * j->vb32;
    if (si4_reserve((void **)&t_s, &t_s_n, (size_t)16 * ncol_max * 4) || si4_reserve((void **)&t_p, &t_p_n, (size_t)16 * ncol_max * 2))
        return; /* the other threads take its tiles */
    configure();
    for (int w; (w = atomic_fetch_add(&j->next, 1)) < j->H * tiles;) {
        const int h = w % j->H, t0 = 16 * (w / j->H);
        tile_rows(j, h, t0, j->T - t0 < 16 ? j->T - t0 : 16, t_s, t_p);
    }
    _tile_release();
}

long ATTN_ENTRY(const float *q, size_t qt, size_t qh, int T, int H, const float *k, const float *v, size_t kl,
                   size_t kh, int L, int Hkv, int D, int start, int window, float scale, float *out, size_t ot,
                   size_t oh) {
    if (T < 1 || H < 1 || Hkv < 1 || H % Hkv || D % 32 || D > 256 || L != start + T) return -2;
    attn_job j = {.q = q, .k = k, .v = v, .out = out, .qt = qt, .qh = qh, .kl = kl, .kh = kh, .ot = ot, .oh = oh,
                  .T = T, .H = H, .L = L, .Hkv = Hkv, .D = D, .start = start, .window = window, .scale = scale};
    j.vb32 = (L + 31) / 32;
    j.kb16 = 2 * j.vb32;
    j.kp = aligned_alloc(64, (size_t)Hkv * j.kb16 * 16 * D * 2);
    j.vp = aligned_alloc(64, (size_t)Hkv * j.vb32 * 32 * D * 2);
    long ok = -1;
    if (j.kp && j.vp) {
        atomic_init(&j.packed, 0);
        si4_pool_run(run_pack, &j, si4_pool_size());
        atomic_init(&j.next, 0);
        si4_pool_run(run_attn, &j, si4_pool_size());
        ok = atomic_load(&j.next) < H * ((T + 15) / 16) ? -1 : 0;
    }
    free(j.kp);
    free(j.vp);
    return ok;
}
