/* Decode attention for one (sequence, chunk of its context) unit of DecodeStack
 * (decode_stack.c), and the fp16 and q8_0 KV writes, written once over the vector vocabulary
 * of each isa_*.c (vf, VW, V_ZERO, V_SET1, V_FMA, V_LOAD, V_STORE, V_LOAD_F16, V_LOAD_I8 (VW
 * int8 values as floats), and V_HSUM(v): the sum of v's lanes; S_F16(h) / S_TO_F16(f): one
 * fp16 value to float and back, rounding to nearest even; optionally V_STORE_F16(p, v)),
 * which defines ATTN_NAME, F16_STORE_NAME and Q8_STORE_NAME and includes this file.
 *
 * The cache holds floats, fp16 values or q8_0 rows (u->kv_type): a q8_0 row of a KV head is
 * hd int8 values q and then an fp16 scale d_g per group g of 32 (hd + hd / 16 bytes; engine:
 * kv_quant.py), read as q_e * d_(e / 32).
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
#define ATTN_I8_1(x) ((float)(x))
ATTN_DOT(attn_dot, float, V_LOAD, ATTN_F32_1)
ATTN_DOT(attn_dot_h, uint16_t, V_LOAD_F16, S_F16)
ATTN_DOT(attn_dot_q, int8_t, V_LOAD_I8, ATTN_I8_1)
ATTN_AXPY(attn_axpy, float, V_LOAD, ATTN_F32_1)
ATTN_AXPY(attn_axpy_h, uint16_t, V_LOAD_F16, S_F16)
ATTN_AXPY(attn_axpy_q, int8_t, V_LOAD_I8, ATTN_I8_1)

#define ATTN_Q8_GROUP 32 /* values per q8_0 scale */

/* Bytes of one KV head's part of a cache row (a row holds every KV head's) */
ATTN_INLINE size_t attn_head_bytes(int hd, const int kv) {
    return kv == SI4_KV_Q8 ? (size_t)hd + 2 * (size_t)(hd / ATTN_Q8_GROUP) : (size_t)hd * (kv == SI4_KV_F16 ? 2 : 4);
}
/* The scale of group g of a q8_0 head row */
ATTN_INLINE float attn_q8_scale(const char *head, int hd, int g) {
    uint16_t d;
    memcpy(&d, head + hd + 2 * g, sizeof d);
    return S_F16(d);
}
/* q . k and out += p v for one KV head's part of a row, in the cache's type */
ATTN_INLINE float attn_dot_any(const float *q, const char *head, int hd, const int kv) {
    if (kv == SI4_KV_Q8) {
        float sum = 0.0f;
        for (int g = 0; g < hd / ATTN_Q8_GROUP; g++)
            sum += attn_q8_scale(head, hd, g) *
                   attn_dot_q(q + g * ATTN_Q8_GROUP, (const int8_t *)head + g * ATTN_Q8_GROUP, ATTN_Q8_GROUP);
        return sum;
    }
    return kv == SI4_KV_F16 ? attn_dot_h(q, (const uint16_t *)head, hd) : attn_dot(q, (const float *)head, hd);
}
ATTN_INLINE void attn_axpy_any(float *out, float p, const char *head, int hd, const int kv) {
    if (kv == SI4_KV_Q8)
        for (int g = 0; g < hd / ATTN_Q8_GROUP; g++)
            attn_axpy_q(out + g * ATTN_Q8_GROUP, p * attn_q8_scale(head, hd, g),
                        (const int8_t *)head + g * ATTN_Q8_GROUP, ATTN_Q8_GROUP);
    else if (kv == SI4_KV_F16)
        attn_axpy_h(out, p, (const uint16_t *)head, hd);
    else
        attn_axpy(out, p, (const float *)head, hd);
}

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

/* The unit, for a cache of type kv (SI4_KV_*): a constant, so each is its own loop. Any head
 * dimension, one query head at a time (see attend_vec for the common case). */
ATTN_INLINE void attend_any(const si4_attn_unit *u, const int kv) {
    const int group = u->group, hd = u->hd, n = u->n_ctx, nh = u->n_kv * group;
    const size_t head_bytes = attn_head_bytes(hd, kv), row_bytes = head_bytes * u->n_kv;
    float mx[SI4_MAX_HEADS], inv[SI4_MAX_HEADS];
    for (int h = 0; h < nh; h++) mx[h] = -INFINITY;
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->kc + (size_t)u->slots[i] * row_bytes; /* every KV head of position i */
        for (int h = 0; h < nh; h++) {
            const float s = attn_dot_any(u->q + (size_t)h * hd, row + (size_t)(h / group) * head_bytes, hd, kv) * u->scale;
            u->scores[(size_t)h * n + i] = s;
            mx[h] = s > mx[h] ? s : mx[h];
        }
    }
    attn_softmax(u, nh, mx, inv);
    memset(u->out, 0, sizeof(float) * (size_t)nh * hd);
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->vc + (size_t)u->slots[i] * row_bytes;
        for (int h = 0; h < nh; h++) {
            const float p = u->scores[(size_t)h * n + i] * inv[h];
            attn_axpy_any(u->out + (size_t)h * hd, p, row + (size_t)(h / group) * head_bytes, hd, kv);
        }
    }
}

#define ATTN_MAXV 16 /* head dimensions of up to 16 vectors take attend_vec */

/* One KV head's key or value at p (nv vectors, hd = nv * VW values), as floats (q8_0: q
 * times its group's scale; a group of 32 is whole vectors, VW dividing 32). */
ATTN_INLINE void load_head(vf *dst, const void *p, int nv, const int kv) {
    for (int v = 0; v < nv; v++)
        dst[v] = kv == SI4_KV_Q8
                     ? V_FMA(V_LOAD_I8((const int8_t *)p + v * VW),
                             V_SET1(attn_q8_scale((const char *)p, nv * VW, v * VW / ATTN_Q8_GROUP)), V_ZERO())
                 : kv == SI4_KV_F16 ? V_LOAD_F16((const uint16_t *)p + v * VW)
                                    : V_LOAD((const float *)p + v * VW);
}

/* As attend_any, for a head dimension of whole vectors: each key and value of a KV head is
 * converted once for its `group` query heads, and a score takes one horizontal sum. */
ATTN_INLINE void attend_vec(const si4_attn_unit *u, const int kv) {
    const int group = u->group, hd = u->hd, n = u->n_ctx, nkv = u->n_kv, nh = nkv * group, nv = hd / VW;
    const size_t head_bytes = attn_head_bytes(hd, kv), row_bytes = head_bytes * nkv;
    const vf one = V_SET1(1.0f);
    float mx[SI4_MAX_HEADS], inv[SI4_MAX_HEADS];
    for (int h = 0; h < nh; h++) mx[h] = -INFINITY;
    for (int i = 0; i < n; i++) {
        const char *row = (const char *)u->kc + (size_t)u->slots[i] * row_bytes;
        for (int g = 0; g < nkv; g++) {
            vf k[ATTN_MAXV];
            load_head(k, row + (size_t)g * head_bytes, nv, kv);
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
            load_head(val, row + (size_t)g * head_bytes, nv, kv);
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
    switch (u->kv_type * 2 + vec) {
    case SI4_KV_F32 * 2 + 1: attend_vec(u, SI4_KV_F32); break;
    case SI4_KV_F16 * 2 + 1: attend_vec(u, SI4_KV_F16); break;
    case SI4_KV_Q8 * 2 + 1: attend_vec(u, SI4_KV_Q8); break;
    case SI4_KV_F32 * 2: attend_any(u, SI4_KV_F32); break;
    case SI4_KV_F16 * 2: attend_any(u, SI4_KV_F16); break;
    default: attend_any(u, SI4_KV_Q8); break;
    }
}

/* dst[i] = src[i] as IEEE binary16, rounded to nearest even (the KV write of an fp16 cache) */
void F16_STORE_NAME(uint16_t *dst, const float *src, int n) {
    int i = 0;
#ifdef V_STORE_F16
    for (; i + VW <= n; i += VW) V_STORE_F16(dst + i, V_LOAD(src + i));
#endif
    for (; i < n; i++) dst[i] = S_TO_F16(src[i]);
}

/* n_heads rows of hd floats -> q8_0 rows (the KV write of a q8_0 cache), as
 * kv_quant.quantize_q8: per group of 32, d = fp16(max|x| / 127), q = x / float(d) rounded to
 * nearest even and clamped to +-127 (0 where d = 0); a row's values, then its groups' d. */
void Q8_STORE_NAME(int8_t *dst, const float *src, int n_heads, int hd) {
    for (int h = 0; h < n_heads; h++) {
        int8_t *row = dst + (size_t)h * attn_head_bytes(hd, SI4_KV_Q8);
        for (int g = 0; g < hd / ATTN_Q8_GROUP; g++) {
            const float *x = src + (size_t)h * hd + g * ATTN_Q8_GROUP;
            int8_t *q = row + g * ATTN_Q8_GROUP;
            float amax = 0.0f;
            for (int e = 0; e < ATTN_Q8_GROUP; e++) amax = fmaxf(amax, fabsf(x[e]));
            const uint16_t dh = S_TO_F16(amax / 127.0f);
            const float d = S_F16(dh);
            for (int e = 0; e < ATTN_Q8_GROUP; e++) {
                float r = d > 0.0f ? rintf(x[e] / d) : 0.0f; /* the default rounding: nearest even */
                r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
                q[e] = (int8_t)r;
            }
            memcpy(row + hd + 2 * g, &dh, sizeof dh);
        }
    }
}
