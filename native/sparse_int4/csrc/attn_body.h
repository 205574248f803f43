/* Decode attention for one (sequence, chunk of its context) unit of DecodeStack
 * (decode_stack.c), and the fp16 KV write, written once over the vector vocabulary of each
 * isa_*.c (vf, VW, V_ZERO, V_SET1, V_FMA, V_LOAD, V_STORE, V_LOAD_F16, and V_HSUM(v): the sum
 * of v's lanes; S_F16(h) / S_TO_F16(f): one fp16 value to float and back, rounding to nearest
 * even; optionally V_STORE_F16(p, v)), which defines ATTN_NAME and F16_STORE_NAME and
 * includes this file.
 *
 * The cache holds floats or fp16 values (u->kv_f16), read as floats.
 * Every query head h of the sequence, over the unit's positions i: s_hi = scale q_h . k_i,
 * p_hi = softmax_i(s_hi), out_h = sum_i p_hi v_i, where k_i, v_i are of KV head h / group
 * (GQA). A position's keys (and values) of all KV heads are one contiguous row of the cache,
 * read once for all heads: a unit that read one KV head's part of each row would leave the
 * hardware prefetcher to fetch the whole rows anyway. Vectors run along the head dimension; a
 * head dimension that is not a multiple of VW takes the scalar loop. A unit that holds a chunk
 * of the context (u->m set) leaves out_h unnormalised, with the chunk's max m_h and
 * denominator l_h = sum_i e^(s_hi - m_h), for decode_stack.c to merge.
 */
#include <math.h>
#include <string.h>

#include "sparse_int4.h"

#define ATTN_INLINE static inline __attribute__((always_inline))

/* q . k over hd floats, k given as float (KV_T float) or fp16 bits (uint16_t) */
#define ATTN_DOT(NAME, KV_T, LOADV, LOAD1)                                       \
    ATTN_INLINE float NAME(const float *q, const KV_T *k, int hd) {              \
        int e = 0;                                                               \
        float sum = 0.0f;                                                        \
        if (hd % VW == 0) {                                                      \
            vf a0 = V_ZERO(), a1 = V_ZERO();                                     \
            for (; e + 2 * VW <= hd; e += 2 * VW) {                              \
                a0 = V_FMA(V_LOAD(q + e), LOADV(k + e), a0);                     \
                a1 = V_FMA(V_LOAD(q + e + VW), LOADV(k + e + VW), a1);           \
            }                                                                    \
            for (; e < hd; e += VW) a0 = V_FMA(V_LOAD(q + e), LOADV(k + e), a0); \
            sum = V_HSUM(a0) + V_HSUM(a1);                                       \
        }                                                                        \
        for (; e < hd; e++) sum += q[e] * LOAD1(k[e]);                           \
        return sum;                                                              \
    }
/* out[e] += p * v[e] */
#define ATTN_AXPY(NAME, KV_T, LOADV, LOAD1)                                                          \
    ATTN_INLINE void NAME(float *out, float p, const KV_T *v, int hd) {                              \
        int e = 0;                                                                                   \
        if (hd % VW == 0) {                                                                          \
            const vf pv = V_SET1(p);                                                                 \
            for (; e < hd; e += VW) V_STORE(out + e, V_FMA(pv, LOADV(v + e), V_LOAD(out + e)));     \
        }                                                                                            \
        for (; e < hd; e++) out[e] += p * LOAD1(v[e]);                                               \
    }
#define ATTN_F32_1(x) (x)
ATTN_DOT(attn_dot, float, V_LOAD, ATTN_F32_1)
ATTN_DOT(attn_dot_h, uint16_t, V_LOAD_F16, S_F16)
ATTN_AXPY(attn_axpy, float, V_LOAD, ATTN_F32_1)
ATTN_AXPY(attn_axpy_h, uint16_t, V_LOAD_F16, S_F16)

/* scores[h] <- e^(scores[h] - mx[h]) for each of the nh heads; inv[h]: the factor that
 * normalises them (1 for a chunk, whose max and sum go to u->m, u->l for the merge). */
ATTN_INLINE void attn_softmax(const si4_attn_unit *u, int nh, const float *mx, float *inv) {
    const int n = u->n_ctx;
    for (int h = 0; h < nh; h++) {
        float *sc = u->scores + (size_t)h * n, sum = 0.0f;
        for (int i = 0; i < n; i++) sum += (sc[i] = expf(sc[i] - mx[h]));
        if (u->m) {
            u->m[h] = mx[h], u->l[h] = sum;
            inv[h] = 1.0f;
        } else {
            inv[h] = 1.0f / sum;
        }
    }
}

/* The unit, for a float (f16 = 0) or fp16 (f16 = 1) cache: a constant, so each is its own
 * loop. Any head dimension, one query head at a time (see attend_vec for the common case). */
ATTN_INLINE void attend_any(const si4_attn_unit *u, const int f16) {
    const int group = u->group, hd = u->hd, n = u->n_ctx, nh = u->n_kv * group;
    const size_t esize = f16 ? 2 : 4;
    float mx[SI4_MAX_HEADS], inv[SI4_MAX_HEADS];
    for (int h = 0; h < nh; h++) mx[h] = -INFINITY;
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->kc + (size_t)u->slots[i] * u->row * esize; /* every KV head of position i */
        for (int h = 0; h < nh; h++) {
            const size_t at = (size_t)(h / group) * hd;
            const float *q = u->q + (size_t)h * hd;
            const float s = (f16 ? attn_dot_h(q, (const uint16_t *)row + at, hd) : attn_dot(q, (const float *)row + at, hd)) *
                            u->scale;
            u->scores[(size_t)h * n + i] = s;
            mx[h] = s > mx[h] ? s : mx[h];
        }
    }
    attn_softmax(u, nh, mx, inv);
    memset(u->out, 0, sizeof(float) * (size_t)nh * hd);
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->vc + (size_t)u->slots[i] * u->row * esize;
        for (int h = 0; h < nh; h++) {
            const size_t at = (size_t)(h / group) * hd;
            const float p = u->scores[(size_t)h * n + i] * inv[h];
            if (f16)
                attn_axpy_h(u->out + (size_t)h * hd, p, (const uint16_t *)row + at, hd);
            else
                attn_axpy(u->out + (size_t)h * hd, p, (const float *)row + at, hd);
        }
    }
}

#define ATTN_MAXV 16 /* head dimensions of up to 16 vectors take attend_vec */

/* One KV head's key or value at p (nv vectors), as floats. */
ATTN_INLINE void load_head(vf *dst, const void *p, int nv, const int f16) {
    for (int v = 0; v < nv; v++)
        dst[v] = f16 ? V_LOAD_F16((const uint16_t *)p + v * VW) : V_LOAD((const float *)p + v * VW);
}

/* As attend_any, for a head dimension of whole vectors: each key and value of a KV head is
 * converted once for its `group` query heads, and a score takes one horizontal sum. */
ATTN_INLINE void attend_vec(const si4_attn_unit *u, const int f16) {
    const int group = u->group, hd = u->hd, n = u->n_ctx, nkv = u->n_kv, nh = nkv * group, nv = hd / VW;
    const size_t esize = f16 ? 2 : 4, head_bytes = (size_t)hd * esize, row_bytes = u->row * esize;
    const vf one = V_SET1(1.0f);
    float mx[SI4_MAX_HEADS], inv[SI4_MAX_HEADS];
    for (int h = 0; h < nh; h++) mx[h] = -INFINITY;
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->kc + (size_t)u->slots[i] * row_bytes;
        for (int g = 0; g < nkv; g++) {
            vf k[ATTN_MAXV];
            load_head(k, row + (size_t)g * head_bytes, nv, f16);
            for (int h = g * group; h < (g + 1) * group; h++) {
                const float *q = u->q + (size_t)h * hd;
                vf a0 = V_ZERO(), a1 = V_ZERO();
                int v = 0;
                for (; v + 2 <= nv; v += 2) {
                    a0 = V_FMA(V_LOAD(q + v * VW), k[v], a0);
                    a1 = V_FMA(V_LOAD(q + (v + 1) * VW), k[v + 1], a1);
                }
                if (v < nv) a0 = V_FMA(V_LOAD(q + v * VW), k[v], a0);
                const float s = V_HSUM(V_FMA(a1, one, a0)) * u->scale;
                u->scores[(size_t)h * n + i] = s;
                mx[h] = s > mx[h] ? s : mx[h];
            }
        }
    }
    attn_softmax(u, nh, mx, inv);
    memset(u->out, 0, sizeof(float) * (size_t)nh * hd);
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->vc + (size_t)u->slots[i] * row_bytes;
        for (int g = 0; g < nkv; g++) {
            vf val[ATTN_MAXV];
            load_head(val, row + (size_t)g * head_bytes, nv, f16);
            for (int h = g * group; h < (g + 1) * group; h++) {
                const vf p = V_SET1(u->scores[(size_t)h * n + i] * inv[h]);
                float *o = u->out + (size_t)h * hd;
                for (int v = 0; v < nv; v++) V_STORE(o + v * VW, V_FMA(p, val[v], V_LOAD(o + v * VW)));
            }
        }
    }
}

void ATTN_NAME(const si4_attn_unit *u) {
    const int vec = u->hd % VW == 0 && u->hd / VW <= ATTN_MAXV;
    if (vec && u->kv_f16)
        attend_vec(u, 1);
    else if (vec)
        attend_vec(u, 0);
    else if (u->kv_f16)
        attend_any(u, 1);
    else
        attend_any(u, 0);
}

/* dst[i] = src[i] as IEEE binary16, rounded to nearest even (the KV write of an fp16 cache) */
void F16_STORE_NAME(uint16_t *dst, const float *src, int n) {
    int i = 0;
#ifdef V_STORE_F16
    for (; i + VW <= n; i += VW) V_STORE_F16(dst + i, V_LOAD(src + i));
#endif
    for (; i < n; i++) dst[i] = S_TO_F16(src[i]);
}
