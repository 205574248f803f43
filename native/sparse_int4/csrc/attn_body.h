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

/* The unit, for a float (f16 = 0) or fp16 (f16 = 1) cache: a constant, so each is its own loop. */
ATTN_INLINE void attend(const si4_attn_unit *u, const int f16) {
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
    for (int h = 0; h < nh; h++) {
        float *sc = u->scores + (size_t)h * n, sum = 0.0f;
        for (int i = 0; i < n; i++) sum += (sc[i] = expf(sc[i] - mx[h]));
        if (u->m) { /* a chunk: the merge normalises */
            u->m[h] = mx[h], u->l[h] = sum;
            inv[h] = 1.0f;
        } else {
            inv[h] = 1.0f / sum;
        }
    }
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

void ATTN_NAME(const si4_attn_unit *u) {
    if (u->kv_f16)
        attend(u, 1);
    else
        attend(u, 0);
}

/* dst[i] = src[i] as IEEE binary16, rounded to nearest even (the KV write of an fp16 cache) */
void F16_STORE_NAME(uint16_t *dst, const float *src, int n) {
    int i = 0;
#ifdef V_STORE_F16
    for (; i + VW <= n; i += VW) V_STORE_F16(dst + i, V_LOAD(src + i));
#endif
    for (; i < n; i++) dst[i] = S_TO_F16(src[i]);
}
