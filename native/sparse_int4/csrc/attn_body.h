/* Decode attention for one (sequence, KV head) unit of DecodeStack (decode_stack.c), written
 * once over the vector vocabulary of each isa_*.c (vf, VW, V_ZERO, V_SET1, V_FMA, V_LOAD,
 * V_STORE, and V_HSUM(v): the sum of v's lanes), which defines ATTN_NAME and includes this file.
 *
 * The unit's `group` query heads (GQA) read each cached key and value once: scores
 * s_hi = scale q_h . k_i, p_hi = softmax_i(s_hi), out_h = sum_i p_hi v_i. Vectors run along the
 * head dimension; a head dimension that is not a multiple of VW takes the scalar loop.
 */
#include <math.h>
#include <string.h>

#include "sparse_int4.h"

#define ATTN_INLINE static inline __attribute__((always_inline))

ATTN_INLINE float attn_dot(const float *q, const float *k, int hd) {
    int e = 0;
    float sum = 0.0f;
    if (hd % VW == 0) {
        vf a0 = V_ZERO(), a1 = V_ZERO();
        for (; e + 2 * VW <= hd; e += 2 * VW) {
            a0 = V_FMA(V_LOAD(q + e), V_LOAD(k + e), a0);
            a1 = V_FMA(V_LOAD(q + e + VW), V_LOAD(k + e + VW), a1);
        }
        for (; e < hd; e += VW) a0 = V_FMA(V_LOAD(q + e), V_LOAD(k + e), a0);
        sum = V_HSUM(a0) + V_HSUM(a1);
    }
    for (; e < hd; e++) sum += q[e] * k[e];
    return sum;
}

/* out[e] += p * v[e] */
ATTN_INLINE void attn_axpy(float *out, float p, const float *v, int hd) {
    int e = 0;
    if (hd % VW == 0) {
        const vf pv = V_SET1(p);
        for (; e < hd; e += VW) V_STORE(out + e, V_FMA(pv, V_LOAD(v + e), V_LOAD(out + e)));
    }
    for (; e < hd; e++) out[e] += p * v[e];
}

void ATTN_NAME(const si4_attn_unit *u) {
    const int group = u->group, hd = u->hd, n = u->n_ctx;
    float mx[64], inv[64];
    for (int h = 0; h < group; h++) mx[h] = -INFINITY;
    for (int i = 0; i < n; i++) {
        const float *k = u->kc + (size_t)u->slots[i] * u->row + u->off;
        for (int h = 0; h < group; h++) {
            const float s = attn_dot(u->q + (size_t)h * hd, k, hd) * u->scale;
            u->scores[(size_t)h * n + i] = s;
            mx[h] = s > mx[h] ? s : mx[h];
        }
    }
    for (int h = 0; h < group; h++) {
        float *sc = u->scores + (size_t)h * n, sum = 0.0f;
        for (int i = 0; i < n; i++) sum += (sc[i] = expf(sc[i] - mx[h]));
        inv[h] = 1.0f / sum;
    }
    memset(u->out, 0, sizeof(float) * (size_t)group * hd);
    for (int i = 0; i < n; i++) {
        const float *v = u->vc + (size_t)u->slots[i] * u->row + u->off;
        for (int h = 0; h < group; h++) attn_axpy(u->out + (size_t)h * hd, u->scores[(size_t)h * n + i] * inv[h], v, hd);
    }
}
