/* A prompt chunk's causal attention in float32 on AVX2 and FMA, for CPUs without AVX512-BF16
 * (AVX2 laptops and desktops, Ice Lake and Cascade Lake servers). torch's float32 attention took
 * 13.5% of a 1,000-token prefill of Qwen2.5-1.5B there, at 45-50 G multiply-adds/s on two cores
 * held to AVX2; and its rows depend on the call's shape, so a prompt resumed from the cache
 * could differ from a cold run in its last bits.
 *
 * The contract is attn_tiles.c's: a row's result depends on its own query, position and keys
 * only. Keys go in blocks of 32 from position 0 whatever the chunk, so key j always sits in
 * vector lane j % 8; a key a row may not see has P = 0 exactly, so the blocks computed for the
 * other rows of its tile add exact zeros to its sums; every sum runs in one order. Unlike the
 * bfloat16 kernels nothing is rounded below float32: a logit is the FMA chain over the head's
 * dims in order, the softmax exact per row over its own keys, O = P V summed key by key, divided
 * by the sum of P at the end.
 *
 * Work: 16 query rows of one head at a time, in groups of 4 rows. S = Q K^T by a 4 x 16 block of
 * accumulators (two vectors of 8 keys for each of 4 rows, a dim at a time: two loads of K,
 * four broadcasts of Q, eight FMAs), K of each kv head packed once per call as blocks of 32
 * keys by D dims, transposed (row d: the block's 32 keys' dim d). O = P V by 4 rows x 16 dims,
 * a key at a time, V packed per kv head as rows of D (zero past the last key, so a padded key's
 * P = 0 times it adds an exact zero).
 *
 * Compiled with -mavx2 -mfma (setup.py); called only where the CPU has them (module.c). */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "qmat.h"
#include "vexp.h"

typedef struct {
    const float *q, *k, *v;
    float *out;
    size_t qt, qh, kl, kh, ot, oh; /* strides in floats: q / out per token and head, k / v per key and head */
    int T, H, L, Hkv, D, start, window;
    float scale;
    int nb;         /* blocks of 32 keys over L */
    float *kp, *vp; /* per kv head: K as nb blocks of (D, 32), V as (32 nb, D) */
    atomic_int packed, next;
} fma_job;

/* K and V of kv head g into their layouts, zero past key L - 1. */
static void pack_head(const fma_job *j, int g) {
    const int D = j->D;
    float *kp = j->kp + (size_t)g * j->nb * 32 * D, *vp = j->vp + (size_t)g * j->nb * 32 * D;
    for (int key = 0; key < 32 * j->nb; key++) {
        float *kt = kp + (size_t)(key / 32) * D * 32 + key % 32, *vr = vp + (size_t)key * D;
        if (key >= j->L) {
            for (int d = 0; d < D; d++) kt[32 * d] = 0.0f;
            memset(vr, 0, (size_t)D * 4);
            continue;
        }
        const float *ks = j->k + (size_t)key * j->kl + (size_t)g * j->kh;
        for (int d = 0; d < D; d++) kt[32 * d] = ks[d];
        memcpy(vr, j->v + (size_t)key * j->kl + (size_t)g * j->kh, (size_t)D * 4);
    }
}

/* kv heads handed out in turn (the pool skips a part whose thread has not started) */
static void run_pack(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    fma_job *j = arg;
    for (int g; (g = atomic_fetch_add(&j->packed, 1)) < j->Hkv;) pack_head(j, g);
}

static _Thread_local float *t_s;
static _Thread_local size_t t_s_n;

/* Which of columns c .. c + 7 lie in [a, b), as an all-ones lane mask. */
static inline __m256 keys_in(int c, int a, int b) {
    const __m256i col = _mm256_add_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i ge = _mm256_cmpgt_epi32(col, _mm256_set1_epi32(a - 1)), lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(b), col);
    return _mm256_castsi256_ps(_mm256_and_si256(ge, lt));
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The first key position p sees. */
static inline int first_key(const fma_job *j, int p) { return j->window > 0 && p - j->window + 1 > 0 ? p - j->window + 1 : 0; }

/* Query rows [t0, t0 + rows) of head h; S holds 16 rows of the tile's columns (blocks vb0 ..). */
static void tile_rows(const fma_job *j, int h, int t0, int rows, float *S) {
    const int D = j->D, g = h / (j->H / j->Hkv);
    const int p0 = j->start + t0;
    const int vb0 = first_key(j, p0) / 32, ncol = 32 * ((p0 + rows - 1) / 32 + 1 - vb0);
    const float *kp = j->kp + (size_t)g * j->nb * 32 * D, *vp = j->vp + (size_t)g * j->nb * 32 * D;
    /* Q scaled, 16 rows of D (rows past `rows` zero) */
    float qs[16 * 256] __attribute__((aligned(32)));
    for (int i = 0; i < 16; i++)
        for (int d = 0; d < D; d += 8)
            _mm256_store_ps(qs + (size_t)i * D + d,
                            i < rows ? _mm256_mul_ps(_mm256_loadu_ps(j->q + (size_t)(t0 + i) * j->qt + (size_t)h * j->qh + d),
                                                     _mm256_set1_ps(j->scale))
                                     : _mm256_setzero_ps());
    /* a group of 4 rows takes the blocks [gb0[r], gb1[r]): its first row's first key to its last row */
    int gb0[4] = {0}, gb1[4] = {0};
    const int groups = (rows + 3) / 4;
    for (int r = 0; r < groups; r++) {
        const int last = 4 * r + 3 < rows ? 4 * r + 3 : rows - 1;
        gb0[r] = first_key(j, p0 + 4 * r) / 32;
        gb1[r] = (p0 + last) / 32 + 1;
    }
    /* S = Q K^T, a block of 32 keys at a time for every group that needs it (the block stays in L1) */
    for (int b = vb0; b < gb1[groups - 1]; b++) {
        const float *kb = kp + (size_t)b * D * 32;
        for (int r = 0; r < groups; r++) {
            if (b < gb0[r] || b >= gb1[r]) continue;
            const float *q0 = qs + (size_t)(4 * r) * D;
            for (int half = 0; half < 2; half++) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                const float *kt = kb + 16 * half;
                for (int d = 0; d < D; d++) {
                    const __m256 k0 = _mm256_load_ps(kt + 32 * d), k1 = _mm256_load_ps(kt + 32 * d + 8);
                    __m256 x = _mm256_broadcast_ss(q0 + d);
                    a0 = _mm256_fmadd_ps(x, k0, a0), a1 = _mm256_fmadd_ps(x, k1, a1);
                    x = _mm256_broadcast_ss(q0 + D + d);
                    a2 = _mm256_fmadd_ps(x, k0, a2), a3 = _mm256_fmadd_ps(x, k1, a3);
                    x = _mm256_broadcast_ss(q0 + 2 * D + d);
                    a4 = _mm256_fmadd_ps(x, k0, a4), a5 = _mm256_fmadd_ps(x, k1, a5);
                    x = _mm256_broadcast_ss(q0 + 3 * D + d);
                    a6 = _mm256_fmadd_ps(x, k0, a6), a7 = _mm256_fmadd_ps(x, k1, a7);
                }
                float *s = S + (size_t)(4 * r) * ncol + 32 * (b - vb0) + 16 * half;
                _mm256_storeu_ps(s, a0), _mm256_storeu_ps(s + 8, a1);
                _mm256_storeu_ps(s + ncol, a2), _mm256_storeu_ps(s + ncol + 8, a3);
                _mm256_storeu_ps(s + 2 * ncol, a4), _mm256_storeu_ps(s + 2 * ncol + 8, a5);
                _mm256_storeu_ps(s + 3 * ncol, a6), _mm256_storeu_ps(s + 3 * ncol + 8, a7);
            }
        }
    }
    /* each row's softmax over its own keys, P in place of S over its group's columns (0 outside
     * its keys; rows past `rows` all 0), and 1 / the sum of P */
    float inv[16];
    for (int i = 0; i < 4 * groups; i++) {
        const int r = i / 4, c0 = 32 * (gb0[r] - vb0), c1 = 32 * (gb1[r] - vb0);
        float *s = S + (size_t)i * ncol;
        if (i >= rows) {
            memset(s + c0, 0, (size_t)(c1 - c0) * 4);
            continue;
        }
        const int pos = p0 + i, a = first_key(j, pos) - 32 * vb0, e = pos + 1 - 32 * vb0; /* its keys: columns [a, e) */
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (int c = a & ~7; c < e; c += 8)
            mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + c), keys_in(c, a, e)));
        const __m256 m = _mm256_set1_ps(hmax8(mv));
        __m256 lv = _mm256_setzero_ps();
        for (int c = c0; c < c1; c += 8) {
            const __m256 p = _mm256_and_ps(keys_in(c, a, e), exp_neg256(_mm256_sub_ps(_mm256_loadu_ps(s + c), m)));
            _mm256_storeu_ps(s + c, p);
            lv = _mm256_add_ps(lv, p);
        }
        inv[i] = 1.0f / hsum8(lv);
    }
    /* O = P V: a block of 32 keys at a time (its 16 KB of V stay in L1), 16 dims of a group's 4
     * rows a step, the sums carried between blocks in o */
    float o[16 * 256] __attribute__((aligned(32)));
    memset(o, 0, (size_t)16 * D * 4);
    for (int b = vb0; b < gb1[groups - 1]; b++) {
        const float *vb = vp + (size_t)(32 * b) * D;
        for (int r = 0; r < groups; r++) {
            if (b < gb0[r] || b >= gb1[r]) continue;
            const float *p = S + (size_t)(4 * r) * ncol + 32 * (b - vb0);
            float *orow = o + (size_t)(4 * r) * D;
            for (int e = 0; e < D; e += 16) {
                __m256 a0 = _mm256_load_ps(orow + e), a1 = _mm256_load_ps(orow + e + 8);
                __m256 a2 = _mm256_load_ps(orow + D + e), a3 = _mm256_load_ps(orow + D + e + 8);
                __m256 a4 = _mm256_load_ps(orow + 2 * D + e), a5 = _mm256_load_ps(orow + 2 * D + e + 8);
                __m256 a6 = _mm256_load_ps(orow + 3 * D + e), a7 = _mm256_load_ps(orow + 3 * D + e + 8);
                for (int key = 0; key < 32; key++) {
                    const __m256 v0 = _mm256_load_ps(vb + (size_t)key * D + e), v1 = _mm256_load_ps(vb + (size_t)key * D + e + 8);
                    __m256 x = _mm256_broadcast_ss(p + key);
                    a0 = _mm256_fmadd_ps(x, v0, a0), a1 = _mm256_fmadd_ps(x, v1, a1);
                    x = _mm256_broadcast_ss(p + ncol + key);
                    a2 = _mm256_fmadd_ps(x, v0, a2), a3 = _mm256_fmadd_ps(x, v1, a3);
                    x = _mm256_broadcast_ss(p + 2 * ncol + key);
                    a4 = _mm256_fmadd_ps(x, v0, a4), a5 = _mm256_fmadd_ps(x, v1, a5);
                    x = _mm256_broadcast_ss(p + 3 * ncol + key);
                    a6 = _mm256_fmadd_ps(x, v0, a6), a7 = _mm256_fmadd_ps(x, v1, a7);
                }
                _mm256_store_ps(orow + e, a0), _mm256_store_ps(orow + e + 8, a1);
                _mm256_store_ps(orow + D + e, a2), _mm256_store_ps(orow + D + e + 8, a3);
                _mm256_store_ps(orow + 2 * D + e, a4), _mm256_store_ps(orow + 2 * D + e + 8, a5);
                _mm256_store_ps(orow + 3 * D + e, a6), _mm256_store_ps(orow + 3 * D + e + 8, a7);
            }
        }
    }
    for (int i = 0; i < rows; i++) {
        float *dst = j->out + (size_t)(t0 + i) * j->ot + (size_t)h * j->oh;
        const __m256 f = _mm256_set1_ps(inv[i]);
        for (int e = 0; e < D; e += 8) _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_load_ps(o + (size_t)i * D + e), f));
    }
}

static void run_attn(void *arg, int part, int n_parts) {
    (void)part, (void)n_parts;
    fma_job *j = arg;
    const int tiles = (j->T + 15) / 16;
    if (si4_reserve((void **)&t_s, &t_s_n, (size_t)16 * 32 * j->nb * 4)) return; /* the other threads take its tiles */
    for (int w; (w = atomic_fetch_add(&j->next, 1)) < j->H * tiles;) {
        const int h = w % j->H, t0 = 16 * (w / j->H);
        tile_rows(j, h, t0, j->T - t0 < 16 ? j->T - t0 : 16, t_s);
    }
}

long qm_attn_fma(const float *q, size_t qt, size_t qh, int T, int H, const float *k, const float *v, size_t kl, size_t kh,
                 int L, int Hkv, int D, int start, int window, float scale, float *out, size_t ot, size_t oh) {
    if (T < 1 || H < 1 || Hkv < 1 || H % Hkv || D % 32 || D > 256 || L != start + T) return -2;
    fma_job j = {.q = q, .k = k, .v = v, .out = out, .qt = qt, .qh = qh, .kl = kl, .kh = kh, .ot = ot, .oh = oh,
                 .T = T, .H = H, .L = L, .Hkv = Hkv, .D = D, .start = start, .window = window, .scale = scale};
    j.nb = (L + 31) / 32;
    const size_t per_head = (size_t)j.nb * 32 * D * 4;
    j.kp = aligned_alloc(64, (size_t)Hkv * per_head);
    j.vp = aligned_alloc(64, (size_t)Hkv * per_head);
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
